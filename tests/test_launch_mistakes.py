"""Every launch mistake is one line before Ray: it names the key or file and the fix, the entry point exits 2 with
no traceback (HYDRA_FULL_ERROR=1 shows one); a launch with several mistakes prints them all, a line each, in one run.

The mistakes run in this process through the entry point's own two stages (`recipe.launch.load`: the command
line, Hydra's compose and the typed config; `recipe.main_ppo.prepare`: the model, data and plug-in checks), the
same calls `python -m recipe.main_ppo` makes before it starts Ray; two real subprocess runs prove the exit code
and that no traceback is printed. docs/reference/launch-errors.md's table is this list with the line each mistake
got: `UPDATE_DOCS=1 pytest tests/test_launch_mistakes.py -k table` rewrites it, the test checks it.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from recipe import launch
from recipe.config_build import problem_lines
from recipe.tasks import gsm8k

REPO = Path(__file__).resolve().parents[1]
PAGE = REPO / "docs" / "reference" / "launch-errors.md"
START, END = "<!-- launch-mistakes:start -->", "<!-- launch-mistakes:end -->"
RECORDS = [{"question": f"Tom has {i} boxes of 3 apples. How many apples?", "answer": f"{i} * 3 = {3 * i}\n#### {3 * i}"}
           for i in range(2, 6)]

# (mistake, its arguments after the base line ({d}: the test's directory), words the line must hold)
MISTAKES = [
    ("misspelt key", ["trainer.total_trainig_steps=3"], "did you mean trainer.total_training_steps?"),
    ("unknown key", ["trainer.nonsense_key=1"], "unknown config key trainer.nonsense_key"),
    ("key given twice", ["actor_rollout_ref.rollout.n=2", "actor_rollout_ref.rollout.n=8"], "given twice"),
    ("verl's --config-path", ["--config-path=/verl/examples/config"], "drop --config-path"),
    ("verl's --config-name", ["--config-name=gsm8k_multiturn_grpo"], "no such preset"),
    ("value of the wrong type", ["data.train_batch_size=four"], "data.train_batch_size='four' has type str"),
    ("override that does not parse", ["data.train_files=[a"], "not a key=value override"),
    ("deleting a key", ["~trainer.seed"], "cannot be deleted"),
    ("one_step_off with the engines on the trainer's GPUs", ["async_training.schedule=one_step_off"],
     "set actor_rollout_ref.hybrid_engine=false"),
    ("verl's fully-async batch keys under the sync schedule", ["async_training.require_batches=2",
                                                              "data.train_batch_size=0"],
     "would ignore it; set async_training.schedule=fully_async"),
    ("a fully_async knob under the sync schedule", ["async_training.staleness_threshold=0.5"],
     "async_training.staleness_threshold=0.5: only async_training.schedule=fully_async reads it"),
    ("fully_async with ReMax", ["async_training.schedule=fully_async", "actor_rollout_ref.hybrid_engine=false",
                                "rollout.nnodes=1", "rollout.n_gpus_per_node=1", "algorithm.adv_estimator=remax"],
     "streams prompt groups"),
    ("a staleness bound outside fully_async", ["async_training.staleness_bound=3"], "staleness_bound is fixed"),
    ("the TransformerEngine spec without TransformerEngine",
     ["actor_rollout_ref.actor.megatron.override_transformer_config.transformer_impl=transformer_engine"],
     "needs TransformerEngine, which is not installed"),
    ("context parallelism", ["actor_rollout_ref.actor.megatron.context_parallel_size=2"],
     "context_parallel_size=2: context parallelism is not supported: splitting a sequence over ranks needs "
     "TransformerEngine's attention"),
    ("critic warm-up without a critic", ["trainer.critic_warmup=5"], "trainer.critic_warmup=5 warms up a critic"),
    ("reference in another dtype than the actor", ["actor_rollout_ref.ref.megatron.dtype=bfloat16"],
     "must equal actor_rollout_ref.actor.megatron.dtype"),
    ("critic from another checkpoint", ["critic.model.path=/models/other"], "must equal actor_rollout_ref.model.path"),
    ("overlong prompts kept", ["data.filter_overlong_prompts=False"], "always dropped at load"),
    ("prompt truncation", ["data.truncation=left"], "prompts are never truncated"),
    ("a reward model", ["reward_model.enable=True"], "a model reward is not supported"),
    ("FSDP strategy", ["actor_rollout_ref.actor.strategy=fsdp"], "Megatron only"),
    ("global micro-batch size", ["actor_rollout_ref.rollout.log_prob_micro_batch_size=8"], "per-GPU size"),
    ("unknown advantage estimator", ["algorithm.adv_estimator=ppo"], "algorithm.adv_estimator is 'ppo'"),
    ("unknown logger", ["trainer.logger=mlflow"], "trainer.logger has ['mlflow']"),
    ("mini-batch not dividing the batch", ["actor_rollout_ref.actor.ppo_mini_batch_size=3"],
     "ppo_mini_batch_size=3 does not divide data.train_batch_size=4"),
    ("greedy validation with n > 1", ["actor_rollout_ref.rollout.val_kwargs.n=4"], "do_sample=true"),
    ("validation without data", ["trainer.test_freq=2"], "data.val_files is empty"),
    ("another inference engine", ["actor_rollout_ref.rollout.name=vllm"], "polyturn drives SGLang only"),
    ("an SGLang argument polyturn sets", ["+actor_rollout_ref.rollout.engine_kwargs.sglang.tp_size=2"],
     "tp_size from actor_rollout_ref.rollout.tensor_model_parallel_size"),
    ("an SGLang argument SGLang does not have",
     ["+actor_rollout_ref.rollout.engine_kwargs.sglang.disable_radix_cashe=True"],
     "disable_radix_cashe (did you mean disable_radix_cache?)"),
    ("no turns allowed", ["actor_rollout_ref.rollout.multi_turn.max_assistant_turns=0"], "or null for no limit"),
    ("missing data file", ["data.train_files=[{d}/nowhere.parquet]"], "data.train_files="),
    ("missing reward file", ["custom_reward_function.path={d}/nowhere.py"], "custom_reward_function.path="),
    ("TP not dividing the heads", ["actor_rollout_ref.actor.megatron.tensor_model_parallel_size=3",
                                   "trainer.n_gpus_per_node=3", "actor_rollout_ref.actor.ppo_mini_batch_size=1",
                                   "actor_rollout_ref.rollout.n=3"],
     "tensor_model_parallel_size=3 does not divide the model's num_attention_heads=4"),
    ("TP not dividing the KV heads", ["actor_rollout_ref.actor.megatron.tensor_model_parallel_size=4",
                                      "trainer.n_gpus_per_node=4"],
     "tensor_model_parallel_size=4 does not divide the model's num_key_value_heads=2"),
    ("engine TP not dividing the KV heads", ["actor_rollout_ref.rollout.tensor_model_parallel_size=4",
                                             "trainer.n_gpus_per_node=4", "actor_rollout_ref.actor.ppo_mini_batch_size=1",
                                             "actor_rollout_ref.rollout.n=4"],
     "actor_rollout_ref.rollout.tensor_model_parallel_size=4 does not divide the model's num_key_value_heads=2"),
    ("more pipeline stages than layers", ["actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=3",
                                          "trainer.n_gpus_per_node=3", "actor_rollout_ref.actor.ppo_mini_batch_size=1",
                                          "actor_rollout_ref.rollout.n=3"],
     "pipeline_model_parallel_size=3 does not divide the model's num_hidden_layers=2"),
    ("virtual stages that do not divide a stage's layers",
     ["actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=2",
      "actor_rollout_ref.actor.megatron.virtual_pipeline_model_parallel_size=2", "trainer.n_gpus_per_node=2",
      "actor_rollout_ref.actor.ppo_mini_batch_size=1"],
     "virtual_pipeline_model_parallel_size=2 does not divide the 1 layers of each pipeline stage"),
    ("virtual stages with fewer samples per rank than stages",
     ["actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=2",
      "actor_rollout_ref.actor.megatron.virtual_pipeline_model_parallel_size=2", "trainer.n_gpus_per_node=2",
      "actor_rollout_ref.actor.ppo_mini_batch_size=1", "actor_rollout_ref.rollout.n=1"],
     "virtual_pipeline_model_parallel_size=2 needs at least pipeline_model_parallel_size=2 samples per rank"),
    ("batch larger than the data", ["data.train_batch_size=8"], "data.train_batch_size=8 exceeds the 4 prompts"),
    ("misspelt reward function", ["custom_reward_function.path={d}/reward.py", "custom_reward_function.name=score"],
     "custom_reward_function.name='score'"),
    ("data source without a scorer", ["data.train_files=[{d}/other_source.parquet]"],
     "data_source ['my/benchmark'] in data.train_files / data.val_files has no outcome scorer"),
    ("model directory without a tokenizer", ["actor_rollout_ref.model.path={d}/no_tokenizer"], "no tokenizer there"),
    ("model directory without config.json", ["actor_rollout_ref.model.path={d}/no_config"], "no config.json there"),
    ("relative model path that does not exist", ["actor_rollout_ref.model.path=./models/nowhere"],
     "actor_rollout_ref.model.path='./models/nowhere': no such file or directory"),
    ("hub id that cannot be fetched", ["actor_rollout_ref.model.path=Qwen/NoSuchModel-0B"],
     "could not be fetched as a hub id"),
    ("malformed tool YAML", ["actor_rollout_ref.rollout.multi_turn.tool_config_path={d}/bad_tool.yaml"],
     "bad_tool.yaml: line 4 is not valid YAML"),
    ("malformed interaction YAML",
     ["actor_rollout_ref.rollout.multi_turn.interaction_config_path={d}/bad_interaction.yaml"],
     "bad_interaction.yaml: line 4 is not valid YAML"),
    ("tool class that does not exist", ["actor_rollout_ref.rollout.multi_turn.tool_config_path={d}/no_class.yaml"],
     "no_class.yaml"),
    ("parquet without the prompt column", ["data.train_files=[{d}/no_prompt.parquet]"],
     "data.train_files: data row {d}/no_prompt.parquet[0]: `prompt` must be a list of chat messages"),
    ("a jsonl given as a train file", ["data.train_files=[{d}/train.jsonl]"],
     "data.train_files: {d}/train.jsonl is not a parquet file"),
    ("unknown interaction name in a row", ["data.train_files=[{d}/unknown_interaction.parquet]"],
     "data.train_files: {d}/unknown_interaction.parquet[0]: interaction_kwargs.name='nosuch' is not registered"),
    ("unknown tool name in tools_kwargs", ["data.train_files=[{d}/unknown_tool.parquet]"],
     "data.train_files: {d}/unknown_tool.parquet[0]: tools_kwargs names unknown tools ['nosuch_tool']"),
    ("every prompt over max_prompt_length", ["data.max_prompt_length=10"],
     "data.train_files: all 4 prompts of ['{d}/train.parquet'] are longer than data.max_prompt_length=10 tokens"),
]


@pytest.fixture(scope="module")
def setup(tiny_model_dir, tmp_path_factory) -> tuple[Path, list[str]]:
    """The test's directory (data, broken files) and the base command line every mistake is added to."""
    d = tmp_path_factory.mktemp("mistakes")
    rows = [gsm8k.make_row(r, "train", i) for i, r in enumerate(RECORDS)]
    gsm8k.write_rows(rows, d / "train.parquet")
    gsm8k.write_rows([{**r, "data_source": "my/benchmark"} for r in rows], d / "other_source.parquet")
    (d / "reward.py").write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                                 "    return 0.0\n")
    (d / "no_tokenizer").mkdir()
    (d / "no_tokenizer" / "config.json").write_text((tiny_model_dir / "config.json").read_text())
    (d / "no_config").mkdir()
    bad = "tools:\n  - class_name: rollout.tools.gsm8k_tool.Gsm8kTool\n    config: {type: native\n"
    (d / "bad_tool.yaml").write_text(bad)
    (d / "bad_interaction.yaml").write_text(bad.replace("tools:", "interaction:"))
    (d / "no_class.yaml").write_text("tools:\n  - class_name: my_package.tools.NoSuchTool\n    config: {}\n")
    gsm8k.write_rows([{k: v for k, v in r.items() if k != "prompt"} for r in rows], d / "no_prompt.parquet")
    (d / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    gsm8k.write_rows([{**r, "extra_info": {**r["extra_info"], "interaction_kwargs": {"name": "nosuch"}}} for r in rows],
                     d / "unknown_interaction.parquet")
    unknown_tool = {"nosuch_tool": {"create_kwargs": {"x": "1"}}}
    gsm8k.write_rows([{**r, "extra_info": {**r["extra_info"], "tools_kwargs": unknown_tool}} for r in rows],
                     d / "unknown_tool.parquet")
    base = ["--config-name", "cpu_tiny", f"actor_rollout_ref.model.path={tiny_model_dir}",
            f"data.train_files=[{d / 'train.parquet'}]", f"trainer.default_local_dir={d / 'out'}"]
    return d, base


def _lines(argv: list[str]) -> list[str] | None:
    """The lines the entry point prints for `argv` before Ray (after `polyturn: error: `), or None when it would
    start."""
    from recipe.main_ppo import USER_ERRORS, prepare

    try:
        cfg, _, _ = launch.load(argv)
        prepare(cfg)
    except USER_ERRORS as err:
        return problem_lines(err)
    return None


def _argv(base: list[str], args: list[str], d: Path) -> list[str]:
    flags = [a for a in args if a.startswith("-")]
    if flags:  # a flag replaces the base's preset
        return [*flags, *base[2:]]
    keys = {a.split("=", 1)[0] for a in args}
    return [*[b for b in base if b.split("=", 1)[0] not in keys], *[a.format(d=d) for a in args]]


@pytest.fixture(scope="module")
def lines(setup) -> list[tuple[str, list[str], str | None]]:
    """Every mistake with the line it gets (None: accepted; several lines joined by a newline), in one process."""
    d, base = setup
    got = [(name, args, _lines(_argv(base, args, d))) for name, args, _ in MISTAKES]
    return [(name, args, None if said is None else "\n".join(said)) for name, args, said in got]


@pytest.mark.unit
def test_the_base_line_starts(setup):
    """Contract: the base line of the mistakes below passes every check (so each mistake is what is refused)."""
    d, base = setup
    assert _lines(base) is None


@pytest.mark.unit
def test_every_launch_mistake_is_one_line_naming_the_key_and_fix(lines, setup):
    """Contract: each of the 50 launch mistakes is refused before Ray with ONE line that holds the words listed for
    it (the key or file, and the fix), the data files' mistakes (a missing column, a jsonl, an unknown tool or
    interaction in a row, every prompt too long) among them."""
    assert len(MISTAKES) >= 50
    for (name, _, want), (_, _, got) in zip(MISTAKES, lines):
        assert got is not None, f"{name}: accepted"
        assert "\n" not in got and want.format(d=setup[0]) in got, f"{name}: {got!r}"


# (mistakes, their arguments after the base line, the start of each line printed, in order)
SEVERAL = [
    ("a misspelt key, a missing data file and bad values in two sections",
     ["trainer.total_trainig_steps=3", "data.train_files=[{d}/nowhere.parquet]", "trainer.max_failed_fraction=2",
      "async_training.staleness_threshold=-1"],
     ["unknown config key trainer.total_trainig_steps; did you mean trainer.total_training_steps?",
      "data.train_files='{d}/nowhere.parquet': no such file or directory", "trainer.max_failed_fraction is 2.0",
      "async_training.staleness_threshold=-1.0; it must be >= 0"]),
    ("a placement that cannot fit, a model layout, a malformed tool YAML, a misspelt reward function and a data file "
     "with an unknown interaction",
     ["actor_rollout_ref.rollout.tensor_model_parallel_size=3", "actor_rollout_ref.actor.megatron.pipeline_model_"
      "parallel_size=1", "trainer.n_gpus_per_node=4", "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=4",
      "actor_rollout_ref.rollout.multi_turn.tool_config_path={d}/bad_tool.yaml",
      "custom_reward_function.path={d}/reward.py", "custom_reward_function.name=score",
      "data.train_files=[{d}/unknown_interaction.parquet]"],
     ["actor_rollout_ref.rollout.tensor_model_parallel_size=3 does not divide trainer.n_gpus_per_node=4",
      "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=4 does not divide the model's num_key_value_heads",
      "{d}/bad_tool.yaml: line 4 is not valid YAML", "custom_reward_function.name='score'"]),
]


@pytest.mark.unit
@pytest.mark.parametrize("name, args, want", SEVERAL, ids=[s[0] for s in SEVERAL])
def test_several_mistakes_are_all_refused_in_one_run(setup, name, args, want):
    """Contract: one launch line with several independent mistakes is refused with every one of them, one line each,
    in one run (not one per run); a check that needs a refused one's result is skipped (no data check without the
    tool registry it validates rows against)."""
    d, base = setup
    got = _lines(_argv(base, args, d))
    assert got is not None and len(got) == len(want), got
    for start in want:
        assert [line for line in got if line.startswith(start.format(d=d))], (start, got)
    assert not [line for line in got if "\n" in line]


# (SFT mistake, its arguments after the SFT base line ({d}: the test's directory), words the line must hold)
SFT_MISTAKES = [
    ("SFT file without messages", ["data.train_files=[{d}/sft_no_messages.parquet]"],
     "data.train_files: {d}/sft_no_messages.parquet[0]: no 'messages' column (columns: ['text']); set "
     "data.multiturn.messages_key"),
    ("SFT batch larger than the data", ["data.train_batch_size=8"],
     "data.train_files hold 2 rows, fewer than one batch of data.train_batch_size=8; lower it or add rows"),
]


@pytest.mark.unit
def test_sft_data_mistakes_are_one_line_each(setup, tiny_model_dir):
    """Contract: the SFT entry's data mistakes are refused before Ray with one line naming the key and the fix (no
    traceback), all in one run: `recipe.main_sft.prepare` loads the data the run trains on."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from recipe.main_ppo import USER_ERRORS
    from recipe.main_sft import prepare
    from recipe.sft_config import SFT

    d = setup[0]
    chat = [{"role": "user", "content": "1 + 1?"}, {"role": "assistant", "content": "2"}]
    pq.write_table(pa.Table.from_pylist([{"messages": chat}] * 2), d / "sft.parquet")
    pq.write_table(pa.Table.from_pylist([{"text": "1 + 1 = 2"}] * 2), d / "sft_no_messages.parquet")
    base = [f"model.partial_pretrain={tiny_model_dir}", f"data.train_files=[{d / 'sft.parquet'}]",
            "data.train_batch_size=2", f"trainer.default_local_dir={d / 'sft_out'}"]

    def lines(args: list[str]) -> list[str] | None:
        try:
            prepare(launch.load(_argv(["-", "-", *base], args, d)[2:], SFT)[0])
        except USER_ERRORS as err:
            return problem_lines(err)
        return None

    assert lines([]) is None
    for name, args, want in SFT_MISTAKES:
        got = lines(args)
        assert got is not None and len(got) == 1 and want.format(d=d) in got[0], (name, got)
    both = lines(["data.train_files=[{d}/sft_no_messages.parquet]", "data.val_files=[{d}/sft.parquet]",
                  "data.train_batch_size=4", "trainer.n_gpus_per_node=4"])
    assert both is not None and len(both) == 2 and "no 'messages' column" in both[0], both
    assert both[1] == "data.val_files hold 2 rows, fewer than the 4 data-parallel ranks; add rows"


def _table(lines, d: Path, model: Path) -> str:
    rows = ["| mistake | arguments | the one line (after `polyturn: error: `) |", "|---|---|---|"]
    for name, args, line in lines:
        shown = " ".join(args).replace("{d}", "$DIR")
        text = (line or "").replace(str(d), "$DIR").replace(str(model), "$MODEL").replace("|", "\\|")
        rows.append(f"| {name} | `{shown}` | {text} |")
    return "\n".join(rows)


@pytest.mark.unit
def test_launch_errors_page_table_is_this_list(lines, setup, tiny_model_dir):
    """Contract: docs/reference/launch-errors.md's table is generated from this test's list and the lines it got
    (UPDATE_DOCS=1 rewrites it)."""
    table = _table(lines, setup[0], tiny_model_dir)
    text = PAGE.read_text()
    assert START in text and END in text, f"{PAGE.name} lacks the {START} ... {END} markers"
    head, rest = text.split(START, 1)
    current, tail = rest.split(END, 1)
    if "1" in (os.environ.get("UPDATE_DOCS"), os.environ.get("UPDATE_README")):  # UPDATE_README: the old name
        PAGE.write_text(f"{head}{START}\n{table}\n{END}{tail}")
    else:
        assert current.strip() == table, ("docs/reference/launch-errors.md's table is stale: "
                                          "UPDATE_DOCS=1 pytest tests/test_launch_mistakes.py -k table")


def _run(argv: list[str], **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "recipe.main_ppo", *argv], cwd=REPO, capture_output=True, text=True,
                          timeout=300, env={**os.environ, **env})


@pytest.mark.integration
def test_the_entry_point_prints_one_line_and_exits_2(setup):
    """Contract: `python -m recipe.main_ppo` with mistakes found inside Hydra's app (a batch larger than the data,
    the last check before Ray, and a misspelt reward function) exits 2, printing one `polyturn: error:` line for each
    and no traceback, and starts nothing (no metrics, no Ray)."""
    d, base = setup
    proc = subprocess.run([sys.executable, "-m", "recipe.main_ppo", *base, "data.train_batch_size=8",
                           f"custom_reward_function.path={d}/reward.py", "custom_reward_function.name=score"],
                          cwd=REPO, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "HYDRA_FULL_ERROR": "0"})
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("polyturn: error: ")]
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert len(errors) == 2 and errors[0].startswith("polyturn: error: custom_reward_function.name='score'")
    assert errors[1] == ("polyturn: error: data.train_batch_size=8 exceeds the 4 prompts loaded from data.train_files "
                         "(after dropping prompts over data.max_prompt_length); lower it to <= 4"), proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr + proc.stdout and "ray" not in proc.stderr.lower()
    assert not (d / "out" / "metrics.jsonl").exists()


@pytest.mark.unit
def test_hydra_full_error_shows_the_traceback(monkeypatch):
    """Contract: the documented switch: with HYDRA_FULL_ERROR=1 a launch mistake is raised as it is (traceback
    included) instead of printed as one line."""
    from recipe.config_schema import ConfigError
    from recipe.main_ppo import report

    monkeypatch.setenv("HYDRA_FULL_ERROR", "1")
    with pytest.raises(ConfigError, match="trainer.critic_warmup"):
        report(ConfigError("trainer.critic_warmup=5: ..."))
    monkeypatch.setenv("HYDRA_FULL_ERROR", "0")
    with pytest.raises(SystemExit) as exit_:
        report(ConfigError("trainer.critic_warmup=5: ..."))
    assert exit_.value.code == 2

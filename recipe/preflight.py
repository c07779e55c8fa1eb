"""Checks that need the model's files, the data or the machine's wandb login, run before Ray starts; each failure is
one ConfigError line naming the config key (and the model field or data file) and the fix.

The config alone is checked by `recipe.config_schema`; here: the model directory's config.json and tokenizer,
the parallel layout against the model's head and layer counts, the SGLang arguments passed through (against SGLang's
ServerArgs), the batch size against the rows loaded, and the outcome scorer of every data source (or the custom
reward function), and a wandb login when `trainer.logger` has wandb (else `wandb.init` fails only after every worker
and engine has started).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from recipe.config_build import Problems
from recipe.config_schema import ROLE_KEYS, ConfigError, PPOConfig

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


def check_model_dir(path: str, key: str = "actor_rollout_ref.model.path") -> None:
    """Refuse a model directory without config.json or a tokenizer, naming the directory."""
    p = Path(path)
    if not (p / "config.json").is_file():
        raise ConfigError(f"{key}={path}: no config.json there; point it at an HF checkpoint directory")
    if not any((p / f).is_file() for f in TOKENIZER_FILES):
        raise ConfigError(f"{key}={path}: no tokenizer there (none of {list(TOKENIZER_FILES)}); save the tokenizer "
                          "into the checkpoint directory (tokenizer.save_pretrained(dir))")


def check_layout(cfg: PPOConfig, hf_config: Any) -> None:
    """Refuse tensor / pipeline / virtual pipeline sizes the model cannot be split by, naming the config key and the
    model field."""
    heads = hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    layers = hf_config.num_hidden_layers
    sizes = [(f"{ROLE_KEYS[role]}.megatron", worker.megatron) for role, worker in cfg.workers().items()]
    tps = [(f"{p}.tensor_model_parallel_size", m.tensor_model_parallel_size) for p, m in sizes]
    tps.append(("actor_rollout_ref.rollout.tensor_model_parallel_size",
                cfg.actor_rollout_ref.rollout.tensor_model_parallel_size))
    for key, tp in tps:
        for field, count in (("num_attention_heads", heads), ("num_key_value_heads", kv_heads)):
            if count % tp:
                raise ConfigError(f"{key}={tp} does not divide the model's {field}={count} (config.json); use a "
                                  f"divisor of {count}")
    for p, m in sizes:
        pp, vpp = m.pipeline_model_parallel_size, m.vpp
        if layers % pp:
            raise ConfigError(f"{p}.pipeline_model_parallel_size={pp} does not divide the model's "
                              f"num_hidden_layers={layers} (config.json); use a divisor of {layers}")
        if (layers // pp) % vpp:
            raise ConfigError(f"{p}.virtual_pipeline_model_parallel_size={vpp} does not divide the {layers // pp} "
                              f"layers of each pipeline stage (num_hidden_layers={layers}, config.json); use a divisor "
                              f"of {layers // pp}")


def check_engine_kwargs(sglang: dict[str, Any]) -> None:
    """Refuse `engine_kwargs.sglang` names that SGLang's ServerArgs does not have (SGLang is imported only when some
    are given), suggesting the near one."""
    if not sglang:
        return
    import difflib

    from rollout.engines.sglang_engine import server_arg_names

    known = server_arg_names()
    unknown = sorted(set(sglang) - known)
    if unknown:
        near = {k: difflib.get_close_matches(k, sorted(known), n=1) for k in unknown}
        raise ConfigError("actor_rollout_ref.rollout.engine_kwargs.sglang has " + ", ".join(
            k + (f" (did you mean {near[k][0]}?)" if near[k] else "") for k in unknown) + ": not arguments of this "
            "SGLang's ServerArgs; fix or drop them")


def check_reward_function(cfg: PPOConfig) -> None:
    """Refuse a custom reward function that cannot be loaded."""
    from recipe.reward.scoring import load_compute_score

    try:
        load_compute_score(cfg.custom_reward_function)
    except ValueError as err:
        raise ConfigError(str(err)) from err


def check_data(cfg: PPOConfig, rows: int, data_sources: set[str]) -> None:
    """Refuse a batch larger than the data and a data source with no scorer (each on its own)."""
    from recipe.tasks import missing_scorer_problems, scorer_paths

    problems = Problems()
    if cfg.data.train_batch_size > rows:
        problems.add(ConfigError(f"data.train_batch_size={cfg.data.train_batch_size} exceeds the {rows} prompts "
                                 "loaded from data.train_files (after dropping prompts over data.max_prompt_length); "
                                 f"lower it to <= {rows}"))
    if cfg.custom_reward_function.path is None:
        for line in missing_scorer_problems(data_sources, scorer_paths(), "in data.train_files / data.val_files"):
            problems.add(ConfigError(line))
    problems.raise_all()


def check_wandb_login(loggers: list[str]) -> None:
    """Refuse `trainer.logger` with wandb when wandb would run online with no login (`tracking.wandb_login_problem`)."""
    from recipe.tracking import wandb_login_problem

    problem = wandb_login_problem(loggers)
    if problem:
        raise ConfigError(problem)

"""Entry point: `python -m recipe.main_sft [--config-name sft_trainer] [key=value ...]` (Hydra): multi-turn SFT.

Trains the Megatron actor (`megatron_workers.actor.MegatronActor.update_sft`, masked token-mean
cross-entropy) on verl's multi-turn SFT parquet (a `messages` column, an optional `tools`
column), tokenized and masked exactly as a rollout of the same conversation would be
(`recipe.data.sft_dataset`): loss on assistant tokens only, system / user / tool tokens masked.
Writes `<trainer.default_local_dir>/hf`, an HF directory (safetensors, config, tokenizer) that
`actor_rollout_ref.model.path` of `recipe.main_ppo` takes as it is, logs `sft/*`, `val/loss` and
`perf/*` through `recipe.tracking`, and prints one JSON line with the run's figures last.

Start-up follows `recipe.main_ppo`: the config, the model directory and the data are checked before anything starts
(every refusal at once, a line each), the driver
joins the Ray cluster at `RAY_ADDRESS` or starts a local one, and the ranks sit on placement
bundles (`recipe.placement.plan_trainer_only`). Where it departs from verl's fsdp_sft_trainer:
Megatron TP x PP x DP ranks instead of FSDP under torchrun; one optimizer step per
`data.train_batch_size` conversations; no intermediate checkpoints, one HF export at the end.
"""
from __future__ import annotations

import functools
import json
import logging
import time
from pathlib import Path
from typing import Any

from recipe.sft_config import SFT, SFTConfig

logger = logging.getLogger(__name__)


def _val_loss(group: Any, batch: dict[str, Any]) -> float:
    """Token-mean cross-entropy of `batch`'s assistant tokens (forward only)."""
    import torch

    from megatron_workers.worker_group import concat_results

    log_probs = concat_results(group.dispatch("compute_log_prob", batch))["log_probs"]  # (B, T), 0 off the mask
    return float(-log_probs.sum() / batch["response_mask"].sum().clamp(min=1).to(torch.float32))


def _model_path(cfg: SFTConfig) -> str:
    """The checkpoint directory (a hub id downloaded here), with its config.json and tokenizer."""
    from recipe import preflight
    from recipe.config_shared import is_hub_id

    path = cfg.model.partial_pretrain
    if is_hub_id(path):
        from huggingface_hub import snapshot_download

        path = snapshot_download(path)
    preflight.check_model_dir(path, "model.partial_pretrain")
    return path


def _load(cfg: SFTConfig, path: str) -> tuple[Any, Any]:
    """The encoded training and validation sets (None without data.val_files), checked against the batch sizes: each
    refusal (a file's rows, a batch larger than its file) one ConfigError line naming the key, all of them together."""
    from transformers import AutoTokenizer

    from recipe.config_build import ConfigError, Problems, problem_lines
    from recipe.data.sft_dataset import SFTDataset
    from rollout.chat_codec import ChatCodec

    d = cfg.data
    codec = ChatCodec.for_tokenizer(AutoTokenizer.from_pretrained(path))  # the rollout's template and stop token

    def load(key: str, files: list[str], at_least: int, why: str) -> SFTDataset:
        try:
            data = SFTDataset(files, codec, messages_key=d.multiturn.messages_key, tools_key=d.multiturn.tools_key,
                              max_length=d.max_length, truncation=d.truncation)
        except (ValueError, KeyError, OSError) as err:  # the rows' own messages name the file and row
            raise ConfigError(f"{key}: {problem_lines(err)[0]}") from err
        if len(data) < at_least:
            raise ConfigError(f"{key} hold {len(data)} rows, {why}")
        return data

    problems = Problems()
    train = problems.check(load, "data.train_files", d.train_files, d.train_batch_size,
                           f"fewer than one batch of data.train_batch_size={d.train_batch_size}; lower it or add rows")
    val = problems.check(load, "data.val_files", d.val_files, cfg.dp_size,
                         f"fewer than the {cfg.dp_size} data-parallel ranks; add rows") if d.val_files else None
    problems.raise_all()
    return train, val


def prepare(cfg: SFTConfig) -> tuple[str, Any, Any]:
    """Everything checked and loaded before Ray starts: the wandb login, the model directory, the data (each check on
    its own; the data needs the model's tokenizer); the model directory, the training and validation sets. Raises one
    ConfigError with every refusal, a line each."""
    from recipe import preflight
    from recipe.config_build import Problems
    from recipe.main_ppo import USER_ERRORS

    problems = Problems(USER_ERRORS)
    problems.check(preflight.check_wandb_login, cfg.trainer.logger)  # not at wandb.init, after the ranks started
    path = problems.check(_model_path, cfg)
    data = problems.check(_load, cfg, path) if path is not None else None
    problems.raise_all()
    return path, *data


def _start_actor(cfg: SFTConfig, path: str, placement: Any) -> Any:
    """The Megatron actor's worker group on the placement's bundles, its model built from `path`."""
    from transformers import AutoConfig

    from megatron_workers.actor import MegatronActor
    from megatron_workers.config import ActorConfig
    from megatron_workers.worker_group import MegatronWorkerGroup, ParallelLayout

    m, d = cfg.megatron, cfg.data
    layout = ParallelLayout(tp=m.tensor_model_parallel_size, pp=m.pipeline_model_parallel_size, vpp=m.vpp,
                            dp=cfg.dp_size)
    group = MegatronWorkerGroup(layout, placement.rank_options("actor"), hf_config=AutoConfig.from_pretrained(path),
                                seed=cfg.seed)
    try:
        placement.check_ranks("actor", [info.gpu_ids for info in group.ranks])
        actor_cfg = ActorConfig(optim=cfg.optim, ppo_mini_batch_size=d.train_batch_size, use_dynamic_bsz=False,
                                ppo_micro_batch_size_per_gpu=d.micro_batch_size_per_gpu, megatron=m)  # verl SFT's rows
        group.build(functools.partial(MegatronActor, path, actor_cfg))
    except BaseException:
        group.shutdown()
        raise
    return group


def _fit(cfg: SFTConfig, group: Any, train: Any, val: Any, tracker: Any) -> dict[str, Any]:
    """Train `trainer.total_training_steps` (or total_epochs) steps, one optimizer step per batch; the run's losses."""
    d, t = cfg.data, cfg.trainer
    batches_per_epoch = len(train) // d.train_batch_size
    steps = t.total_training_steps or t.total_epochs * batches_per_epoch
    logger.info("SFT: %d conversations (%d loss tokens), %d steps of %d", len(train), train.num_loss_tokens, steps,
                d.train_batch_size)
    # every DP rank gets an equal share of the validation rows (the remainder is left out)
    val_batch = val.collate(val.items[:len(val) // cfg.dp_size * cfg.dp_size]) if val is not None else None
    losses: list[float] = []
    val_loss = None
    batches = train.batches(d.train_batch_size, seed=cfg.seed)
    for step in range(1, steps + 1):
        batch = next(batches)
        t0 = time.monotonic()
        metrics = group.dispatch("update_sft", batch, mini_batches=1)[0]  # summed over DP ranks already
        dt = time.monotonic() - t0
        losses.append(metrics["sft/sft_loss"])
        metrics.update({"sft/epoch": (step - 1) / batches_per_epoch,
                        "sft/loss_tokens": float(batch["response_mask"].sum()),
                        "perf/time_per_step": dt,
                        "perf/throughput": float(batch["attention_mask"].sum()) / dt / group.world_size})
        if val_batch is not None and (step == steps or (t.test_freq > 0 and step % t.test_freq == 0)):
            val_loss = metrics["val/loss"] = _val_loss(group, val_batch)
        tracker.log(metrics, step)
    result: dict[str, Any] = {"sft_loss_first": losses[0], "sft_loss_last": losses[-1], "steps": steps}
    if val_loss is not None:
        result["val_loss"] = val_loss
    return result


def run(cfg: SFTConfig, config_dict: dict | None = None,
        prepared: tuple[str, Any, Any] | None = None) -> dict[str, Any]:
    """Load and encode the data (`prepare`, unless given its result), start the ranks, train, export
    `<default_local_dir>/hf`; returns the run's figures."""
    import ray

    from recipe.main_ppo import start_ray
    from recipe.placement import Placement, plan_trainer_only
    from recipe.tracking import Tracking

    t_start = time.monotonic()
    path, train, val = prepared or prepare(cfg)
    t = cfg.trainer
    plan = plan_trainer_only(t.nnodes, t.n_gpus_per_node)
    start_ray(cfg.ray_init)
    placement = group = tracker = None
    try:
        placement = Placement(plan)
        group = _start_actor(cfg, path, placement)
        tracker = Tracking(t.logger, t.project_name, t.experiment_name, t.default_local_dir, config=config_dict)
        t_train = time.monotonic()
        result = _fit(cfg, group, train, val, tracker)
        result["train_s"] = round(time.monotonic() - t_train, 2)
        out = Path(t.default_local_dir) / "hf"
        group.call_all("export_hf", str(out))
        logger.info("SFT model written to %s (use it as actor_rollout_ref.model.path)", out)
    finally:
        if tracker is not None:
            tracker.finish()
        if group is not None:
            group.shutdown()
        if placement is not None:
            placement.shutdown()
        ray.shutdown()
    return {**result, "wall_s": round(time.monotonic() - t_start, 2), "hf_dir": str(out)}


def main(argv: list[str] | None = None) -> None:
    """The entry point, recipe.main_ppo's `hydra_entry` with verl's SFT keys: a launch mistake is one line and exit 2,
    before Ray; the run prints its final JSON line."""
    from recipe.main_ppo import USER_ERRORS, hydra_entry, report

    def body(config_dict: dict) -> None:
        try:
            config = SFTConfig.from_dict(config_dict)
            prepared = prepare(config)  # the model and data checks, before Ray
        except USER_ERRORS as err:
            report(err)
        print(json.dumps(run(config, config_dict, prepared)), flush=True)

    hydra_entry(argv, SFT, body)


if __name__ == "__main__":
    main()

"""Entry point: `python -m recipe.main_ppo [--config-name PRESET] [key=value ...]` (Hydra).

Validates the config into `PPOConfig` (errors name the key before anything starts), finds the
model (a local directory, a hub id downloaded here, or the tiny test model written into the
output dir by the CPU preset), loads and validates the data against the tool and interaction
registries, starts a local Ray cluster, builds the Megatron actor group (+ reference when a
KL term is used, + critic for GAE) and the SGLang engines, and runs the trainer.

Where it departs from verl's `main_ppo`: the SGLang engines run in this (driver) process,
each with its scheduler in its own subprocesses, rather than inside the actor's Ray workers;
weights reach them from the actor group as HF-named tensor buckets.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Iterator
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf

from megatron_workers import cpu_compat
from recipe.config_schema import PPOConfig, is_hub_id
from recipe.data.dataset import PromptBatch, RLDataset
from recipe.tracking import Tracking
from recipe.trainer import Trainer, Workers

logger = logging.getLogger(__name__)


def model_dir(cfg: PPOConfig) -> str:
    """The policy checkpoint directory: the configured one, a hub download, or a fresh tiny model."""
    m = cfg.actor_rollout_ref.model
    if m.path is None:
        from recipe.tiny_model import write_tiny_checkpoint

        return str(write_tiny_checkpoint(Path(cfg.trainer.default_local_dir) / "tiny_model", seed=cfg.trainer.seed))
    if is_hub_id(m.path):
        from huggingface_hub import snapshot_download

        return snapshot_download(m.path)
    return m.path


def start_ray(cfg: PPOConfig) -> None:
    """A local Ray cluster with `ray_init.num_cpus` CPUs (reuses one already started)."""
    import ray

    if not ray.is_initialized():
        ray.init(num_cpus=cfg.ray_init.num_cpus, _temp_dir=cfg.ray_init.temp_dir, include_dashboard=False,
                 log_to_driver=True)


def build_workers(cfg: PPOConfig, model_path: str) -> Workers:
    """Megatron groups (actor, reference if a KL term is used, critic for GAE) and the SGLang engines."""
    from transformers import AutoConfig

    from megatron_workers.actor import MegatronActor
    from megatron_workers.critic import MegatronCritic
    from megatron_workers.worker_group import MegatronWorkerGroup, ParallelLayout
    from rollout.engines.sglang_engine import SGLangEngine

    ar = cfg.actor_rollout_ref
    m = ar.actor.megatron
    layout = ParallelLayout(tp=m.tensor_model_parallel_size, pp=m.pipeline_model_parallel_size, dp=cfg.dp_size)
    hf_config = AutoConfig.from_pretrained(model_path)

    def group(role: type, role_cfg, **kwargs) -> MegatronWorkerGroup:
        g = MegatronWorkerGroup(layout, hf_config=hf_config, seed=cfg.trainer.seed)
        g.build(functools.partial(role, model_path, role_cfg, **kwargs))
        return g

    temperature = ar.rollout.temperature
    actor = group(MegatronActor, ar.actor, temperature=temperature)
    ref = group(MegatronActor, dataclasses.replace(ar.actor, optim=None), temperature=temperature) \
        if cfg.use_reference else None
    critic = group(MegatronCritic, cfg.critic) if cfg.use_critic else None
    r = ar.rollout
    engines = [
        SGLangEngine(model_path, name=f"engine{i}", dtype=r.dtype, tp_size=r.tensor_model_parallel_size,
                     base_gpu_id=i * r.tensor_model_parallel_size, mem_fraction_static=r.gpu_memory_utilization,
                     max_total_tokens=r.max_total_tokens, random_seed=cfg.trainer.seed + i, log_level="error")
        for i in range(r.num_engines)
    ]
    return Workers(actor=actor, ref=ref, critic=critic, engines=engines)


def build(cfg: PPOConfig, config_dict: dict | None = None) -> tuple[Trainer, Iterator[PromptBatch]]:
    """Everything a run needs, started: the trainer and its endless prompt batches."""
    from transformers import AutoTokenizer

    from rollout.agent_loop import AgentLoop
    from rollout.interactions.registry import InteractionRegistry
    from rollout.tools.registry import ToolRegistry

    path = model_dir(cfg)
    tokenizer = AutoTokenizer.from_pretrained(path)
    mt = cfg.actor_rollout_ref.rollout.multi_turn
    tools = ToolRegistry.from_config(mt.tool_config_path)
    interactions = InteractionRegistry.from_config(mt.interaction_config_path)
    dataset = RLDataset(cfg.data.train_files, tools, interactions, tokenizer=tokenizer,
                        max_prompt_length=cfg.data.max_prompt_length)
    logger.info("data: %d prompts from %s", len(dataset), cfg.data.train_files)
    start_ray(cfg)
    workers = build_workers(cfg, path)
    loop = AgentLoop(workers.engines, tokenizer, cfg.actor_rollout_ref.rollout, tools=tools, interactions=interactions)
    t = cfg.trainer
    tracker = Tracking(t.logger, t.project_name, t.experiment_name, t.default_local_dir, config=config_dict)
    batches = dataset.batches(cfg.data.train_batch_size, seed=t.seed, shuffle=cfg.data.shuffle)
    return Trainer(cfg, workers, loop, tracker), batches


def run(cfg: PPOConfig, config_dict: dict | None = None) -> None:
    """Build, train for `trainer.total_training_steps`, shut everything down."""
    import ray

    trainer, batches = build(cfg, config_dict)
    try:
        trainer.fit(batches)
    finally:
        trainer.close()
        for engine in trainer.workers.engines:
            engine.shutdown()
        ray.shutdown()


@hydra.main(config_path="config", config_name="ppo_trainer", version_base="1.3")
def main(cfg: DictConfig) -> None:
    """Hydra entry: validate the config, then `run`."""
    cpu_compat.apply_cpu_compat()  # this process's start (it imports the Megatron worker classes)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", force=True)
    config_dict = OmegaConf.to_container(cfg, resolve=True)
    run(PPOConfig.from_dict(config_dict), config_dict)


if __name__ == "__main__":
    main()

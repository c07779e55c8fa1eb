"""Entry point: `python -m recipe.main_ppo [--config-name PRESET] [key=value ...]` (Hydra).

Validates the config into `PPOConfig` and plans the placement (`recipe.placement`; errors name
the key before anything starts), finds the model (a local directory, a hub id downloaded here,
or the tiny test model written into the output dir by the CPU preset), loads and validates the
data against the tool and interaction registries, joins the Ray cluster at `RAY_ADDRESS` (after
`ray start --head` / `ray start --address=...` on the nodes) or starts a local one, creates the
plan's placement groups, builds the Megatron actor group (+ reference when a KL term is used,
+ critic for GAE) and the engines as Ray actors on their bundles, and runs the trainer.

Where it departs from verl's `main_ppo`: the driver holds handles only and runs no SGLang engine (importing this
module loads no SGLang; the loop imports SGLang's tool-call parser when it first parses tools, after the adapter);
the reference and critic share the actor's GPUs, each in its own TP x PP layout (and, in hybrid mode, the engines
too) instead of
asking for resource pools of their own.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import os
import sys
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, NoReturn

import hydra
from omegaconf import DictConfig, OmegaConf

import cpu_standins
from megatron_workers import cpu_compat
from megatron_workers.worker_group import RankFailure
from recipe import checkpoint, launch, preflight
from recipe.config_build import Problems, problem_lines
from recipe.config_schema import (
    ConfigError,
    PPOConfig,
    RayInitConfig,
    is_hub_id,
)
from recipe.data.dataset import PromptBatch, RLDataset
from recipe.data.samples import take_samples
from recipe.flops import MFU
from recipe.logs import setup_logging
from recipe.memory_plan import check_memory, driver_gpu_bytes
from recipe.placement import Placement, PlacementPlan, plan_placement
from recipe.reward import RewardFn
from recipe.tracking import Tracking
from recipe.colocation import move_megatron_state
from recipe.engine_faults import RunFailed
from recipe.trainer import Trainer, Workers
from recipe.validation import Validator, validation_loop
from rollout.plugins import PluginConfigError

logger = logging.getLogger(__name__)


def model_dir(cfg: PPOConfig) -> str:
    """The policy checkpoint directory: the configured one, a hub download, or a fresh tiny model."""
    m = cfg.actor_rollout_ref.model
    if m.path is None:
        from recipe.tiny_model import write_tiny_checkpoint

        return str(write_tiny_checkpoint(Path(cfg.trainer.default_local_dir) / "tiny_model", seed=cfg.trainer.seed))
    if is_hub_id(m.path):
        from huggingface_hub import snapshot_download

        try:
            return snapshot_download(m.path)
        except Exception as err:  # no network, no such repo, gated: one line, the key and both readings of it
            logger.debug("hub download of %s failed: %r", m.path, err)
            raise ConfigError(f"actor_rollout_ref.model.path={m.path!r} is not a directory here and could not be "
                              "fetched as a hub id (no network, no such repository, or a gated one); give an existing "
                              "checkpoint directory or a reachable hub id") from err
    return m.path


def start_ray(ray_init: RayInitConfig) -> None:
    """Join the cluster at `RAY_ADDRESS` when it is set, else start a local one with `ray_init.*` (reuses a
    connection this process already has)."""
    import ray

    if ray.is_initialized():
        return
    if os.environ.get("RAY_ADDRESS"):
        ray.init(address="auto", log_to_driver=True)
        logger.info("joined the Ray cluster at %s: %s", os.environ["RAY_ADDRESS"], ray.cluster_resources())
    else:
        ray.init(num_cpus=ray_init.num_cpus, _temp_dir=ray_init.temp_dir, include_dashboard=False,
                 log_to_driver=True)


def build_workers(cfg: PPOConfig, model_path: str, plan: PlacementPlan) -> Workers:
    """The plan's placement groups, the Megatron groups (actor, reference if a KL term is used, critic for
    GAE) and the engines on their bundles, and the weight sync between them."""
    from transformers import AutoConfig

    from megatron_workers.actor import MegatronActor
    from megatron_workers.critic import MegatronCritic
    from megatron_workers.worker_group import MegatronWorkerGroup, ParallelLayout
    from recipe.weight_sync import WeightSync
    from rollout.engines.engine_actor import EngineClient

    ar = cfg.actor_rollout_ref
    m = ar.actor.megatron
    remote = ar.model.trust_remote_code
    hf_config = AutoConfig.from_pretrained(model_path, trust_remote_code=remote)
    placement = Placement(plan)
    roles = cfg.workers()

    def group(role: str, cls: type, **kwargs) -> MegatronWorkerGroup:
        """The role's ranks in its own layout (its TP x PP, DP filling the trainer's ranks), on the same bundles."""
        rm = roles[role].megatron
        layout = ParallelLayout(tp=rm.tensor_model_parallel_size, pp=rm.pipeline_model_parallel_size, vpp=rm.vpp,
                                dp=cfg.role_dp_size(roles[role]))
        g = MegatronWorkerGroup(layout, placement.rank_options(role), hf_config=hf_config, seed=cfg.trainer.seed,
                                name=role, collective_timeout_s=cfg.trainer.collective_timeout_s)
        placement.check_ranks(role, [info.gpu_ids for info in g.ranks])
        g.build(functools.partial(cls, model_path, roles[role], trust_remote_code=remote, **kwargs))
        return g

    r = ar.rollout
    colocated = plan.hybrid and placement.use_gpus

    def launch(i: int, e) -> EngineClient:
        return EngineClient.launch(model_path, name=f"engine{i}", ray_options=placement.engine_options(i),
                                   **engine_kwargs(cfg, i, e.tp, e.base_gpu_id, colocated))

    temperature = ar.rollout.temperature
    with ThreadPoolExecutor(max_workers=len(plan.engines), thread_name_prefix="engine-launch") as pool:
        def start_engines() -> list[Future]:
            return [pool.submit(launch, i, e) for i, e in enumerate(plan.engines)]

        # Engines that share no GPU memory with the ranks start while the ranks build (their start-up is
        # mostly waiting on their own processes); colocated ones size their KV cache from the GPU memory
        # free when they start, so they wait until the training state is offloaded.
        starting = None if colocated else start_engines()
        actor = group("actor", MegatronActor, temperature=temperature)
        ref = group("ref", MegatronActor, temperature=temperature) if "ref" in plan.roles else None
        critic = group("critic", MegatronCritic) if "critic" in plan.roles else None
        move_megatron_state([g for g in (actor, ref, critic) if g is not None], m, "offload")
        engines = [f.result() for f in (starting or start_engines())]
    mode = r.update_weights_mode or ("tensor" if plan.hybrid else "distributed")
    weight_sync = WeightSync(
        actor, engines, mode=mode, bucket_bytes=r.update_weights_bucket_megabytes << 20, engine_dtype=r.dtype,
        check=r.check_weights, tensor_copies=plan.tensor_copies if mode == "tensor" else None,
        disk_dir=str(Path(cfg.trainer.default_local_dir) / "weight_sync"))
    # Engines and ranks take turns on GPU memory only where there is some: on a cluster without GPUs
    # there is nothing to hand over (and SGLang 0.5.23's release ends in torch.cuda.synchronize()).
    return Workers(actor=actor, ref=ref, critic=critic, engines=engines, weight_sync=weight_sync,
                   colocated=colocated, placement=placement)


def engine_kwargs(cfg: PPOConfig, i: int, tp: int, base_gpu_id: int, colocated: bool) -> dict[str, Any]:
    """The SGLang `ServerArgs` engine `i` starts with (`tp` GPUs from `base_gpu_id`): polyturn's, then the user's
    `engine_kwargs.sglang` (which may not set polyturn's own, `rollout.config.SGLANG_OWNED`)."""
    r = cfg.actor_rollout_ref.rollout
    return {"log_level": "error", **r.engine_kwargs.sglang, "tp_size": tp, "base_gpu_id": base_gpu_id,
            "dtype": r.dtype, "mem_fraction_static": r.gpu_memory_utilization, "max_total_tokens": r.max_total_tokens,
            "random_seed": cfg.trainer.seed + i, "enable_memory_saver": colocated,
            "enable_deterministic_inference": r.deterministic,
            "trust_remote_code": cfg.actor_rollout_ref.model.trust_remote_code}


@dataclasses.dataclass
class Prepared:
    """What `prepare` checked and loaded before Ray starts."""

    plan: PlacementPlan  # the placement groups and who gets which bundles
    resume: Path | None  # the checkpoint to continue from
    state: checkpoint.TrainerState | None  # its step and wandb run
    path: str  # the model directory
    tokenizer: Any
    tools: Any  # ToolRegistry
    interactions: Any  # InteractionRegistry
    dataset: RLDataset
    val_prompts: list | None  # validation prompts (uid val/<i>), or None without data.val_files


def prepare(cfg: PPOConfig) -> Prepared:
    """Everything checked and loaded before Ray starts (recipe.preflight): the placement plan, the checkpoint to
    resume, the wandb login, the model directory (config.json, tokenizer, layout against its heads and layers), the
    memory plan, the tool and interaction YAML, the data (batch size, a scorer per data source). Every independent
    check runs; one that needs a failed one's result is skipped; all refusals are raised together as one ConfigError,
    a line each naming the key."""
    from rollout.interactions.registry import InteractionRegistry
    from rollout.tools.registry import ToolRegistry
    from recipe.tasks import verl_aliases

    problems = Problems(USER_ERRORS)
    plan = problems.check(plan_placement, cfg)  # refuses a layout that cannot fit before anything starts
    problems.check(preflight.check_wandb_login, cfg.trainer.logger)
    resume = problems.check(_resume_dir, cfg)
    state = checkpoint.TrainerState.read(resume) if resume is not None else None  # the step and wandb run it continues
    model = problems.check(_model, cfg, plan)
    mt = cfg.actor_rollout_ref.rollout.multi_turn
    # multi_turn.enable=false: single turn, so no tool or interaction is loaded (rows' kwargs are dropped at load)
    aliases = verl_aliases()  # verl's paths of the tasks' parts (verl's scorers), for verl's YAML
    tools = problems.check(ToolRegistry.from_config, mt.tool_config_path if mt.enable else None, aliases=aliases,
                           function_tool_path=mt.function_tool_path if mt.enable else None)
    interactions = problems.check(InteractionRegistry.from_config, mt.interaction_config_path if mt.enable else None,
                                  aliases=aliases)
    problems.check(preflight.check_reward_function, cfg)
    problems.check(preflight.check_engine_kwargs, cfg.actor_rollout_ref.rollout.engine_kwargs.sglang)
    data = None
    if model is not None and tools is not None and interactions is not None:  # rows are checked against them
        data = problems.check(_data, cfg, model[1], tools, interactions)
    if data is not None:
        sources = {p.data_source for p in data[0].items + (data[1] or [])}
        problems.check(preflight.check_data, cfg, len(data[0]), sources)
    problems.raise_all()
    return Prepared(plan, resume, state, model[0], model[1], tools, interactions, *data)


def _resume_dir(cfg: PPOConfig) -> Path | None:
    """The checkpoint directory to resume from (None: a fresh start); a missing one refused naming the key."""
    t = cfg.trainer
    try:
        return checkpoint.resume_dir(t.resume_mode, t.default_local_dir, t.resume_from_path)
    except (FileNotFoundError, ValueError) as err:
        raise ConfigError(str(err)) from err


def _model(cfg: PPOConfig, plan: PlacementPlan | None) -> tuple[str, Any]:
    """The model directory and its tokenizer, checked: its files, the parallel layout against its heads and layers,
    and (with a plan) the memory plan."""
    from transformers import AutoConfig, AutoTokenizer

    path = model_dir(cfg)
    preflight.check_model_dir(path)
    remote = cfg.actor_rollout_ref.model.trust_remote_code
    hf_config = AutoConfig.from_pretrained(path, trust_remote_code=remote)
    preflight.check_layout(cfg, hf_config)
    if plan is not None:
        check_memory(cfg, plan, hf_config, driver_gpu_bytes())  # hybrid: refuses a plan that cannot fit
    return path, AutoTokenizer.from_pretrained(path, trust_remote_code=remote)


def _data(cfg: PPOConfig, tokenizer: Any, tools: Any, interactions: Any) -> tuple[RLDataset, list | None]:
    """The training prompts and the validation prompts (uid val/<i>; None without data.val_files), each file's
    refusal naming its key."""
    default_agent = cfg.actor_rollout_ref.rollout.agent.default_agent_loop  # rows without agent_name
    template_kwargs = cfg.data.apply_chat_template_kwargs  # every render: the prompts here, the rollout's turns
    problems = Problems()

    def load(key: str, files: list[str]) -> RLDataset:
        try:
            return RLDataset(files, tools, interactions, tokenizer=tokenizer,
                             max_prompt_length=cfg.data.max_prompt_length, default_agent=default_agent,
                             chat_template_kwargs=template_kwargs)
        except (ValueError, KeyError, OSError) as err:  # the rows' own messages name the file and row
            raise ConfigError(f"{key}: {problem_lines(err)[0]}") from err

    dataset = problems.check(load, "data.train_files", cfg.data.train_files)
    val_data = problems.check(load, "data.val_files", cfg.data.val_files) if cfg.data.val_files else None
    problems.raise_all()
    dataset.items = take_samples(dataset.items, cfg.data.train_max_samples, shuffle=cfg.data.shuffle,
                                 seed=cfg.trainer.seed)
    logger.info("data: %d prompts from %s", len(dataset), cfg.data.train_files)
    if val_data is None:
        return dataset, None
    val_items = take_samples(val_data.items, cfg.data.val_max_samples, shuffle=cfg.data.shuffle, seed=cfg.trainer.seed)
    logger.info("validation data: %d prompts from %s", len(val_items), cfg.data.val_files)
    return dataset, [dataclasses.replace(p, uid=f"val/{i}") for i, p in enumerate(val_items)]


def build(cfg: PPOConfig, config_dict: dict | None = None,
          prepared: Prepared | None = None) -> tuple[Trainer, Iterator[PromptBatch]]:
    """Everything a run needs, started (after `prepare`, unless given its result): the trainer and its endless
    prompt batches; with a checkpoint to resume (`trainer.resume_mode`), the trainer is restored from it and the
    engines synced before this returns."""
    from transformers import AutoConfig

    from rollout.agent_loop import AgentLoop

    p = prepared or prepare(cfg)
    plan, resume, state, path, tokenizer = p.plan, p.resume, p.state, p.path, p.tokenizer
    tools, interactions, dataset, val_prompts = p.tools, p.interactions, p.dataset, p.val_prompts
    start_ray(cfg.ray_init)
    cpu_standins.check_ray_node_gpus()  # a node whose GPUs torch cannot use stops here, before anything is placed
    workers = build_workers(cfg, path, plan)
    loop = AgentLoop(workers.engines, tokenizer, cfg.actor_rollout_ref.rollout, tools=tools, interactions=interactions,
                     chat_template_kwargs=cfg.data.apply_chat_template_kwargs)
    t = cfg.trainer
    tracker = Tracking(t.logger, t.project_name, t.experiment_name, t.default_local_dir, config=config_dict,
                       run_id=state.wandb_run_id if state else None, resume_step=state.step if state else None,
                       dump_dirs=[t.rollout_data_dir, t.validation_data_dir])
    batches = dataset.batches(cfg.data.train_batch_size, seed=t.seed, shuffle=cfg.data.shuffle)
    validator = None
    if val_prompts is not None:
        val_kwargs = cfg.actor_rollout_ref.rollout.val_kwargs
        validator = Validator(val_prompts, validation_loop(loop, tokenizer, val_kwargs), val_kwargs,
                              RewardFn(cfg.reward, cfg.custom_reward_function), log_generations=t.log_val_generations,
                              seed=t.seed if cfg.actor_rollout_ref.rollout.deterministic else None)
    mfu = MFU.for_run(AutoConfig.from_pretrained(path, trust_remote_code=cfg.actor_rollout_ref.model.trust_remote_code),
                      t.peak_tflops_per_gpu, t.n_gpus_per_node * t.nnodes)
    trainer = Trainer(cfg, workers, loop, tracker, validator=validator,
                      batches_per_epoch=len(dataset) // cfg.data.train_batch_size, mfu=mfu)
    if resume is not None:
        try:
            trainer.resume(resume, batches)
        except BaseException:
            trainer.close()
            raise
    return trainer, batches


def run(cfg: PPOConfig, config_dict: dict | None = None, prepared: Prepared | None = None) -> None:
    """Build, train for `trainer.total_training_steps`, shut everything down."""
    import ray

    trainer, batches = build(cfg, config_dict, prepared)
    try:
        trainer.fit(batches)
    finally:
        trainer.close()
        ray.shutdown()  # a joined cluster keeps running; this process only disconnects


# A fault that stopped a run (recipe.trainer, megatron_workers.worker_group): one line, exit 1.
RUN_FAULTS = (RunFailed, RankFailure)

# A launch mistake: printed as one line (HYDRA_FULL_ERROR=1: raised, traceback included).
USER_ERRORS = (ConfigError, PluginConfigError)


def report(err: BaseException) -> NoReturn:
    """Print the launch mistakes, one line each, and exit 2; with HYDRA_FULL_ERROR=1, raise them with the
    traceback."""
    if os.environ.get("HYDRA_FULL_ERROR") == "1":
        raise err
    print("\n".join(f"polyturn: error: {line}" for line in problem_lines(err)), file=sys.stderr, flush=True)
    sys.exit(2)


def hydra_entry(argv: list[str] | None, entry: launch.Entry, body: Callable[[dict[str, Any]], None]) -> None:
    """The entry points' start: read the command line (verl's keys, recipe.launch) and compose and validate it (a
    launch mistake: one line, exit 2), then hand the cleaned overrides to Hydra's app (its run directory, log file
    and logging), which adapts this process (cpu_compat), logs the start-up warning and calls `body(config_dict)`."""
    argv = sys.argv[1:] if argv is None else argv
    try:
        plan = launch.load(argv, entry)[2]
    except USER_ERRORS as err:
        report(err)

    @hydra.main(config_path=str(launch.CONFIG_DIR), config_name=plan.config_name, version_base="1.3")
    def app(cfg: DictConfig) -> None:
        cpu_compat.apply_cpu_compat()  # this process's start (it imports the Megatron worker classes)
        setup_logging()  # keeps Hydra's log file handler; filters third-party import noise
        if plan.warning():
            logger.warning("%s", plan.warning())
        body(OmegaConf.to_container(cfg, resolve=True))

    sys.argv = [sys.argv[0], *plan.hydra_flags, *plan.overrides]
    app()


def main(argv: list[str] | None = None) -> None:
    """The entry point (`hydra_entry`): checks the model and data, then runs. Every launch mistake before Ray is one
    line and exit code 2; a fault that stops the run is one line and exit code 1."""

    def body(config_dict: dict[str, Any]) -> None:
        try:
            config = PPOConfig.from_dict(config_dict)
            prepared = prepare(config)  # the model and data checks, before Ray
        except USER_ERRORS as err:
            report(err)
        try:
            run(config, config_dict, prepared)
        except RUN_FAULTS as err:  # a fault that stopped the run: one line, exit 1 (details logged above it)
            print(f"polyturn: error: {err}", file=sys.stderr, flush=True)
            sys.exit(1)

    hydra_entry(argv, launch.PPO, body)


if __name__ == "__main__":
    main()

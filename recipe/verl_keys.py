"""verl's trainer keys that are not polyturn keys, and what each becomes here: the table `VERL_KEYS`.

polyturn matches verl v0.9.x. Every key of verl v0.9's full Megatron trainer config
(`_generated_ppo_megatron_trainer.yaml`, and the keys its fully-async config adds) is either a polyturn key of the
same name (`recipe.config_schema`) or has a `Rule` in this table, by dotted key or by a section with everything
under it (`tests/test_verl_keys.py` walks verl's list): honoured as it is (`accept`: the values polyturn always has,
verl's default among them), renamed onto polyturn's counterpart, accepted when it equals a polyturn key (`same_as`),
mapped once composed (`composed`), warned as having no effect here (dropped, listed in the one start-up warning), or
refused with the reason and the polyturn key or fix. A key is warned about only where dropping it cannot change what
is trained (speed, memory, logging, another engine's or backend's knob); any other value polyturn does not do is
refused. `recipe.launch.prepare` applies the table; a `*.<name>` row matches that last name in any section. The
Megatron roles' rows are `recipe.verl_keys_roles`'.
"""
from __future__ import annotations

from recipe.verl_keys_roles import (CRITIC, NO_MOE, PROFILER, ROLLOUT, Rule, actor_keys, critic_keys, no_effect, only,
                                    ref_keys, role_keys)

__all__ = ["VERL_BATCH", "VERL_KEYS", "Rule"]

VERL_BATCH = ("async_training.require_batches", "rollout.total_rollout_steps")
"""verl's fully async trainer's batch keys, mapped onto polyturn's once composed (`launch.fully_async_overrides`)."""

_ASYNC_NO_EFFECT = {"use_trainer_do_validate": "validation runs in the trainer's process either way",
                    "use_dynamic_resource_scheduling": "the engines keep their own pool (rollout.*)",
                    "dynamic_schedule_policy": "verl's dynamic resource scheduling",
                    "dynamic_schedule_deactivate_ratio": "verl's dynamic resource scheduling",
                    "dynamic_schedule_enable_rebalance": "verl's dynamic resource scheduling",
                    "concurrent_samples_per_replica": "the engines take every request the agent loop sends"}
_MULTIMODAL = no_effect("polyturn trains text-only models: image, video and audio columns are not read")
_NO_RM = "a model reward is not supported (rewards: custom_reward_function.*, reward.*)"
_NO_SANDBOX_SCORE = only("scoring code through sandbox fusion is not built: give your scorer as "
                         "custom_reward_function.path", None)


def _rollout() -> dict[str, Rule]:
    """verl's `actor_rollout_ref.rollout.*` keys that polyturn's RolloutConfig (SGLang engines, agent loop) lacks."""
    r = ROLLOUT
    engine_layout = no_effect(f"the engines' layout is {r}.tensor_model_parallel_size on every engine (no effect on "
                          "what is sampled)", 1)
    no_quant = only(f"quantized rollouts are not built: the engines serve {r}.dtype; drop the key", None)
    return {
        f"{r}.mode": no_effect("the rollout is always the async agent loop", "async"),
        f"{r}.nnodes": only("the engines' own pool is rollout.nnodes / rollout.n_gpus_per_node (with "
                               "actor_rollout_ref.hybrid_engine=false); drop the key", 0),
        f"{r}.n_gpus_per_node": Rule("the engines' own pool is rollout.n_gpus_per_node; in the hybrid layout they use "
                                     "trainer.n_gpus_per_node", same_as="trainer.n_gpus_per_node"),
        f"{r}.full_determinism": Rule("reproducible rollouts", rename=f"{r}.deterministic"),
        f"{r}.seed": no_effect("engine i samples with seed trainer.seed + i; set trainer.seed"),
        f"{r}.prompt_length": Rule("the prompt budget is data.max_prompt_length; drop the key",
                                   same_as="data.max_prompt_length"),
        f"{r}.single_turn_response_length": no_effect("verl v0.9 reads it nowhere (its fully-async Megatron line sets "
                                                      "it)"),
        f"{r}.ignore_eos": only("generation stops at the model's end-of-sequence token; drop the key", False),
        f"{r}.do_sample": only(f"training rollouts always sample (greedy: {r}.temperature=0); drop the key", True),
        f"{r}.logprobs_mode": only("the engines return SGLang's log-probs of the processed (temperature-scaled) "
                                      "distribution, verl's default; drop the key", "processed_logprobs"),
        **{f"{r}.{k}": no_effect("CUDA-graph capture (speed)") for k in ("enforce_eager", "cudagraph_capture_sizes")},
        **{f"{r}.{k}": engine_layout for k in ("data_parallel_size", "expert_parallel_size",
                                               "pipeline_model_parallel_size")},
        **{f"{r}.{k}": no_effect(f"SGLang's scheduler defaults apply (the KV cache size is {r}.max_total_tokens)")
           for k in ("max_num_batched_tokens", "max_num_seqs", "scheduling_policy", "enable_chunked_prefill")},
        f"{r}.enable_prefix_caching": no_effect("SGLang's radix cache is always on (speed only)", True),
        f"{r}.load_format": no_effect("the engines load the checkpoint, then take the trainer's weights before the first "
                                  "rollout"),
        f"{r}.layered_summon": no_effect("an FSDP weight-gathering knob (the sync streams per tensor here)", False),
        f"{r}.disable_log_stats": no_effect("SGLang's own statistics logging"),
        f"{r}.skip_tokenizer_init": no_effect("the engines take and return token ids either way"),
        f"{r}.engine_kwargs.sglang.enable_memory_saver": no_effect(
            "polyturn turns SGLang's memory saver on exactly when the engines share GPUs with the trainer"),
        **{f"{r}.engine_kwargs.{k}": no_effect("another engine's arguments; polyturn runs SGLang") for k in ("vllm",
                                                                                                         "trtllm")},
        f"{r}.multi_turn.num_repeat_rollouts": only("not built: each prompt is rolled out rollout.n times; drop the "
                                                       "key", None),
        f"{r}.multi_turn.tokenization_sanity_check_mode": no_effect(
            "the engine's token ids are kept as sampled; no re-tokenization to check"),
        f"{r}.multi_turn.use_inference_chat_template": no_effect("the model's own chat template is used"),
        f"{r}.calculate_log_probs": no_effect("the engine's log-probs are always kept with each sampled token", True),
        f"{r}.agent.num_workers": no_effect("verl's agent-loop worker processes (the agent loop is asyncio here)"),
        f"{r}.agent.agent_loop_config_path": only(f"a custom agent loop cannot run here: the loop is polyturn's "
                                                     f"({r}.agent.default_agent_loop); drop the key", None),
        f"{r}.agent.custom_async_server": only("a custom rollout server cannot run here: the engines are "
                                                  "polyturn's SGLang actors; drop the key", None),
        f"{r}.checkpoint_engine.update_weights_bucket_megabytes": Rule(
            "the weight sync's bucket size", rename=f"{r}.update_weights_bucket_megabytes"),
        f"{r}.checkpoint_engine.backend": no_effect(f"the weight sync's path: {r}.update_weights_mode"),
        f"{r}.checkpoint_engine.engine_kwargs": no_effect(f"the weight sync's path: {r}.update_weights_mode", {}),
        f"{r}.checkpoint_engine.custom_backend_module": only(
            f"a custom weight-sync backend cannot load here: {r}.update_weights_mode picks polyturn's paths; drop the "
            "key", None),
        f"{r}.enable_rollout_routing_replay": only(f"MoE routing replay is not built ({NO_MOE}); drop the key",
                                                      False),
        f"{r}.moe_load_balance_metrics_interval": no_effect(f"an MoE metric ({NO_MOE})"),
        f"{r}.quantization": no_quant,
        f"{r}.quantization_config_file": no_quant,
        f"{r}.mtp": only("multi-token prediction is not built (no speculative decoding); drop the key", None),
        f"{r}.qat": only("quantization-aware training is not built; drop the key", None),
        f"{r}.disaggregation.enabled": only("prefill/decode disaggregation is not built; drop the key", False),
        f"{r}.disaggregation": no_effect("read only with disaggregation.enabled=True (refused here)"),
        f"{r}.standalone_gpu_memory_utilization": no_effect(f"every engine uses {r}.gpu_memory_utilization", None),
        f"{r}.free_cache_engine": no_effect("engines always release memory while Megatron trains", True),
        f"{r}.multi_stage_wake_up": no_effect("verl's engine wake-up staging"),
        f"{r}.trace": no_effect("verl's rollout tracing (trainer.rollout_data_dir dumps trajectories)"),
        f"{r}.prometheus": no_effect("verl's Prometheus metrics export"),
        f"{r}.profiler": PROFILER,
    }


def _data() -> dict[str, Rule]:
    """verl's `data.*` keys that polyturn's DataConfig does not have."""
    return {
        "data.tokenizer": only("the tokenizer is read from actor_rollout_ref.model.path; put it there", None),
        "data.use_shm": no_effect("verl's copy of the files into shared memory (load speed)", False),
        "data.prompt_key": only("rows keep verl's `prompt` column; rename the column", "prompt"),
        "data.reward_fn_key": only("a row's scorer is picked by its data_source column; rename the column",
                                   "data_source"),
        "data.val_batch_size": no_effect("validation rolls out every validation prompt at once"),
        "data.gen_batch_size": no_effect("the rollouter streams prompt groups one by one (verl's fully async "
                                         "gen_batch_size=1)", 1, None),
        **{f"data.{k}": Rule(f"verl copies actor_rollout_ref.rollout.multi_turn.{k}; drop the key",
                             same_as=f"actor_rollout_ref.rollout.multi_turn.{k}")
           for k in ("tool_config_path", "function_tool_path")},
        "data.return_raw_chat": only("the agent loop always renders the raw chat messages itself; drop the key",
                                     True),
        "data.return_raw_input_ids": no_effect("the agent loop tokenizes the raw chat itself", False),
        "data.return_full_prompt": no_effect("a debugging field of verl's batches", False),
        "data.seed": no_effect("the prompt order is seeded by trainer.seed; set trainer.seed"),
        "data.dataloader_num_workers": no_effect("prompts are read in the trainer's process (speed only)"),
        "data.validation_shuffle": no_effect("validation reads every prompt in the file's order", False),
        "data.filter_overlong_prompts": only(
            "prompts longer than data.max_prompt_length are always dropped at load (verl's filter_overlong_prompts="
            "True); drop the key", True),
        "data.filter_overlong_prompts_workers": no_effect("prompts are filtered in the trainer's process"),
        "data.truncation": only("prompts are never truncated: longer ones than data.max_prompt_length are dropped "
                                "at load; drop the key", "error"),
        "data.trust_remote_code": Rule("the data is tokenized with the policy's tokenizer, loaded with "
                                       "actor_rollout_ref.model.trust_remote_code; set that",
                                       same_as="actor_rollout_ref.model.trust_remote_code"),
        "data.custom_cls": only("a custom dataset class cannot load here: rows are verl's parquet rows "
                                "(recipe.data.dataset); drop the key", None),
        "data.continuous_token.enable": no_effect("the engine's token ids are always kept across turns (verl's "
                                                  "continuous token stream)", True),
        "data.continuous_token": no_effect("read only with continuous_token.enable"),
        **{f"data.{k}": _MULTIMODAL for k in ("image_key", "video_key", "audio_key", "image_patch_size",
                                              "return_multi_modal_inputs", "mm_processor_kwargs")},
    }


def _reward() -> dict[str, Rule]:
    """verl v0.9's `reward.*` section (and its old top-level `reward_model.*`, `sandbox_fusion.*`)."""
    return {
        **{f"reward.custom_reward_function.{k}": Rule("verl v0.9's place of the scorer",
                                                      rename=f"custom_reward_function.{k}")
           for k in ("path", "name", "reward_kwargs")},
        **{f"{s}.reward_kwargs": no_effect("read only by verl's dapo / limited reward managers (refused by "
                                           "reward.reward_manager.name here); the scorer's own arguments are "
                                           "custom_reward_function.reward_kwargs") for s in ("reward", "reward_model")},
        "reward.num_workers": no_effect("rewards are computed in the trainer's process"),
        "reward.reward_manager.source": only("rewards come from recipe.reward (verl's naive manager); drop the key",
                                             "register"),
        "reward.reward_manager.name": only("rewards come from recipe.reward (verl's naive manager: one score per "
                                           "trajectory); give your scorer as custom_reward_function.path", "naive"),
        "reward.reward_manager.module": only("a custom reward manager cannot load here; give your scorer as "
                                             "custom_reward_function.path", None, "custom_reward_manager"),
        "reward.reward_model.enable": only(f"{_NO_RM}; drop the key", False),
        "reward.reward_model": no_effect(f"read only with reward.reward_model.enable=True: {_NO_RM}"),
        "reward.sandbox_fusion.url": _NO_SANDBOX_SCORE,
        "sandbox_fusion.url": _NO_SANDBOX_SCORE,
        **{f"{s}.{k}": no_effect("read only with sandbox_fusion.url (refused here)")
           for s in ("reward.sandbox_fusion", "sandbox_fusion") for k in ("max_concurrent", "memory_limit_mb")},
        "reward_model.enable": only(f"{_NO_RM}; drop the key", False, None),
        "reward_model.reward_manager": only("rewards come from recipe.reward (verl's naive manager); give your scorer as "
                                            "custom_reward_function.path", "naive", None),
        "reward_model": only(f"{_NO_RM}; drop reward_model.*", None),
    }


def _algorithm() -> dict[str, Rule]:
    """verl's `algorithm.*` keys that polyturn's AlgorithmConfig does not have."""
    rc = "algorithm.rollout_correction"
    return {
        f"{rc}.bypass_mode": only("old log-probs are always recomputed by the trainer (the decoupled mode); drop the "
                                  "key", False),
        f"{rc}.use_policy_gradient": only("the policy loss is always PPO's clipped surrogate; drop the key", False),
        f"{rc}.loss_type": no_effect("verl reads it only with bypass_mode=True (refused here); the policy loss is PPO's "
                                     "clipped surrogate", "ppo_clip"),
        "algorithm.filter_groups.max_inflight_gen_batches": no_effect(
            "how many extra batches verl generates at once; which groups are kept is the same", 1),
        "algorithm.use_pf_ppo": only("PF-PPO's reweighting is not built; drop the key", False),
        "algorithm.pf_ppo": no_effect("read only with algorithm.use_pf_ppo=True (refused here)"),
        "distillation.enabled": only("on-policy distillation is not built; drop the key", False),
        "distillation": no_effect("read only with distillation.enabled=True (refused here)"),
    }


def _trainer() -> dict[str, Rule]:
    """verl's `trainer.*` keys that polyturn's TrainerConfig does not have, and its other run-level sections."""
    v1 = "trainer.v1"
    return {
        "trainer.balance_batch": no_effect("it reorders samples over data-parallel ranks for speed; the batch is "
                                           "the same"),
        "trainer.esi_redundant_time": no_effect("verl's elastic-instance save timing"),
        "trainer.default_hdfs_dir": no_effect("checkpoints are written to trainer.default_local_dir only", None),
        "trainer.del_local_ckpt_after_load": no_effect("local checkpoints are kept after a resume", False),
        "trainer.max_critic_ckpt_to_keep": Rule("a checkpoint holds every role, counted by "
                                                "trainer.max_actor_ckpt_to_keep; drop the key",
                                                same_as="trainer.max_actor_ckpt_to_keep"),
        "trainer.ray_wait_register_center_timeout": no_effect("verl's worker registration timeout"),
        "trainer.device": only("the device follows the Ray cluster (GPUs when it has them); drop the key", "cuda"),
        "trainer.use_v1": no_effect("verl's trainer version; the schedule is async_training.schedule"),
        f"{v1}.trainer_mode": only("the schedule is async_training.schedule (sync, one_step_off, fully_async); set it "
                                   "there and drop the key", "sync"),
        f"{v1}.sampler.custom_sampler": only("a custom sampler cannot load here: prompts are drawn by "
                                             "data.shuffle and trainer.seed; drop the key", None),
        f"{v1}.sampler.sync_refill_failed_groups": only("failed groups are not refilled; drop the key", False),
        v1: no_effect("read only by verl's v1 trainer's async modes and sampler (the schedule here is "
                      "async_training.schedule)"),
        "ray_kwargs.ray_init.num_cpus": Rule("Ray's CPU count", rename="ray_init.num_cpus"),
        "ray_kwargs.timeline_json_file": no_effect("verl's Ray timeline dump"),
        "transfer_queue": no_effect("verl's data transfer service (the batch moves the same here)"),
        **{f"skip.{k}.enable": only("not built: rollouts are always generated (trainer.rollout_data_dir dumps them); "
                                    "drop the key", False) for k in ("rollout", "rollout_tq", "async_rollout")},
        "skip": no_effect("read only with skip.*.enable=True (refused here)"),
        "global_profiler": PROFILER,
        "rollout.n": Rule("the samples per prompt: it must equal actor_rollout_ref.rollout.n; set that",
                          same_as=f"{ROLLOUT}.n"),
        **{k: Rule("verl's fully async trainer's batch key", composed=True) for k in VERL_BATCH},
        **{f"async_training.{k}": no_effect(why) for k, why in _ASYNC_NO_EFFECT.items()},
        "async_training.use_rollout_log_probs": only(
            "old log-probs are always recomputed by the trainer, and the engine's are used through "
            "algorithm.rollout_correction.*; drop the key", False),
        "*._target_": only("verl's config-class marker: polyturn's sections are its own dataclasses; drop the key"),
    }


VERL_KEYS: dict[str, Rule] = {
    **role_keys("actor_rollout_ref.actor"), **actor_keys(), **ref_keys(), **role_keys(CRITIC), **critic_keys(),
    **_rollout(), **_data(), **_reward(), **_algorithm(), **_trainer(),
}
"""verl keys that are not polyturn keys, by dotted key, by section, or by last name (`*.<name>`)."""

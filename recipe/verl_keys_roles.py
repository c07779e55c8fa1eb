"""The `Rule` of a verl key, and the table's rows for verl's Megatron roles (`actor_rollout_ref.actor`, `.ref`,
`.model`, `critic`): each role's Megatron, optimizer, model and checkpoint keys that polyturn does not have.

`recipe.verl_keys` holds the rest of the table and puts it together (`VERL_KEYS`); its docstring says what a row
means.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Rule:
    """What one verl key becomes. `accept`: the values polyturn honours as they are (None: any value);
    `rename`: the polyturn key that takes the value; `warn`: a knob with no
    effect here (dropped, listed in the start-up warning); `same_as`: the key is accepted when the composed config's
    `same_as` key holds the same value (checked after composing); `why`: what happens here and the fix."""

    why: str
    accept: tuple | None = ()
    rename: str | None = None
    warn: bool = False
    same_as: str | None = None
    composed: bool = False
    """Mapped once the config is composed (`Launch.verl_batch`, `fully_async_overrides`)."""


def no_effect(why: str, *accept: object) -> Rule:
    """A knob with no effect on the result here: `accept`ed values pass in silence, any other is warned about."""
    return Rule(why, accept=accept or None, warn=True)


def only(why: str, *accept: object) -> Rule:
    """A key whose other values polyturn does not do: `accept`ed values pass, any other is refused with `why`."""
    return Rule(why, accept=accept)


ACTOR, REF, CRITIC, ROLLOUT, MODEL = ("actor_rollout_ref.actor", "actor_rollout_ref.ref", "critic",
                                      "actor_rollout_ref.rollout", "actor_rollout_ref.model")

_NO_CP = ("context parallelism is not supported: splitting a sequence over ranks needs TransformerEngine's attention "
          "(Megatron's TE layer spec), and polyturn runs the local layer spec without TransformerEngine")
NO_MOE = "polyturn builds no mixture-of-experts model (megatron_workers/adapters: qwen2, llama, qwen3)"
PROFILER = no_effect("verl's profiler")
_FSDP = "an FSDP knob (polyturn trains with Megatron: {}.megatron.*)"
_PACKED = "sequences are always packed without padding here"
_ADAPTERS = "the HF <-> Megatron conversion is polyturn's own (megatron_workers/adapters)"
_NO_QAT = only("quantization-aware training is not built; drop the key", False)
_QAT_OFF = no_effect("read only with qat.enable=True (not built)")
_NO_REPLAY = only(f"MoE routing replay is not built ({NO_MOE}); drop the key", "disabled", None)
_CHECKPOINT = ("every checkpoint holds the model, optimizer, LR scheduler, RNG and step, verl's default contents; "
               "HF weights: python -m recipe.export_hf")
_DEFAULT_CONTENTS = ["model", "optimizer", "extra"]

# The reference's Megatron keys it cannot set on its own (its layout, actor_rollout_ref.ref.megatron.*_size, it can):
# the KL term compares its log-probs with the actor's, which another dtype or model code would round differently.
_REF_AS_ACTOR = {"dtype": "the KL term compares the reference's log-probs with the actor's: same dtype",
                 "sequence_parallel": "the reference runs the actor's model code",
                 "override_transformer_config": "the reference runs the actor's model code"}


def _megatron(role: str, trains: bool) -> dict[str, Rule]:
    """verl's `<role>.megatron.*` keys that polyturn's MegatronConfig does not have (all roles alike)."""
    p = f"{role}.megatron"
    overrides = f"{CRITIC if role == CRITIC else ACTOR}.megatron.override_transformer_config"
    no_ep = f"expert parallelism is not built ({NO_MOE}); drop the key"
    no_dist = (f"the model is loaded from the HF checkpoint {MODEL}.path; export the Megatron checkpoint to HF and "
               "point that key at it")
    return {
        f"{p}.expert_model_parallel_size": only(no_ep, 1),
        f"{p}.expert_tensor_parallel_size": only(no_ep, None, 1),
        f"{p}.use_dist_checkpointing": only(no_dist, False),
        f"{p}.dist_checkpointing_path": only(no_dist, None),
        f"{p}.dist_checkpointing_prefix": no_effect("read only with use_dist_checkpointing (refused here)"),
        **{f"{p}.{k}": no_effect("checkpoints are polyturn's per-rank format (megatron_workers/checkpoint.py)")
           for k in ("dist_ckpt_optim_fully_reshardable", "distrib_optim_fully_reshardable_mem_efficient")},
        f"{p}.dynamic_context_parallel": only(f"{_NO_CP}; drop the key", False),
        f"{p}.max_seqlen_per_dp_cp_rank": only(f"{_NO_CP}; drop the key", None),
        **{f"{p}.{k}": no_effect("a memory knob of verl's entropy computation")
           for k in ("entropy_from_logits_with_chunking", "entropy_from_logits_chunk_size")},
        f"{p}.override_ddp_config": only("Megatron's DDP settings are polyturn's (megatron_workers/runner.py), "
                                            "not passed through; drop the key", {}),
        f"{p}.override_mcore_model_config": only(f"set Megatron model fields in {overrides}", {}),
        f"{p}.use_mbridge": no_effect(_ADAPTERS),
        f"{p}.vanilla_mbridge": no_effect(_ADAPTERS),
        f"{p}.use_remove_padding": no_effect(_PACKED, True),
        **{f"{p}.{k}": no_effect(f"padding of verl's unpadded-off (BSHD) path; {_PACKED}")
           for k in ("pad_bshd_to_minibatch_max", "pad_to_length", "pad_to_length_bucket")},
        f"{p}.use_megatron_fsdp": no_effect("Megatron _FSDP is not built; the distributed optimizer shards the state",
                                        False),
        f"{p}.forward_only": only("verl sets it per role (the reference is forward-only, the actor and critic "
                                     "train); drop the key", not trains),
        f"{p}.router_replay": _NO_REPLAY,
        f"{p}.qat.enable": _NO_QAT,
        f"{p}.qat": _QAT_OFF,
    }


def _optim(role: str) -> dict[str, Rule]:
    """verl's `<role>.optim.*` keys that polyturn's OptimConfig (Megatron's Adam and LR scheduler) does not have."""
    p = f"{role}.optim"
    offload = no_effect(f"where Adam's step runs changes memory and speed, not the update; offload with "
                    f"{role}.megatron.optimizer_offload")
    return {
        f"{p}.lr_warmup_steps_ratio": only(f"give the warm-up in optimizer steps: {p}.lr_warmup_steps", 0.0, 0),
        f"{p}.total_training_steps": only(f"verl fills it from the trainer; the LR schedule's length is "
                                             f"{p}.lr_decay_steps", -1),
        f"{p}.betas": only(f"use {p}.adam_beta1 and {p}.adam_beta2", [0.9, 0.999]),
        f"{p}.optimizer": only("Megatron's Adam (decoupled weight decay) is the only optimizer built; drop the key",
                                  "adam", "adamw"),
        f"{p}.weight_decay_incr_style": only(f"weight decay is constant ({p}.weight_decay); drop the key",
                                                "constant"),
        f"{p}.lr_wsd_decay_steps": only(f"WSD's decay phase is not configurable here; use {p}.lr_decay_style "
                                           "constant, linear or cosine", None),
        f"{p}.lr_wsd_decay_style": no_effect("read only with lr_decay_style=WSD, whose decay phase is refused here",
                                         "exponential"),
        f"{p}.use_checkpoint_opt_param_scheduler": no_effect(
            "on resume the LR schedule continues from the checkpoint (Megatron's default); with an unchanged config "
            "verl's False gives the same schedule", True),
        f"{p}.use_precision_aware_optimizer": no_effect("a memory layout only while the gradient and moment dtypes are "
                                                    "fp32, as they always are here", False),
        **{f"{p}.{k}": only("main gradients and Adam moments are fp32 here; drop the key", "fp32")
           for k in ("main_grads_dtype", "exp_avg_dtype", "exp_avg_sq_dtype")},
        f"{p}.use_layer_wise_distributed_optimizer": no_effect(
            f"a sharding layout (verl's Muon path); the distributed optimizer is {p}.use_distributed_optimizer", False),
        **{f"{p}.muon_{k}": no_effect("read only with optim.optimizer=muon (not built)")
           for k in ("momentum", "nesterov", "split_qkv", "scale_mode", "coefficient_type", "num_ns_steps", "tp_mode",
                     "fp32_matmul_prec", "extra_scale_factor", "scalar_optimizer", "match_adamw_update_rms")},
        f"{p}.override_optimizer_config": only(f"Megatron OptimizerConfig fields are not passed through: the "
                                                  f"optimizer is {p}.*; drop the key", {}),
        **{f"{p}.override_optimizer_config.{k}": offload
           for k in ("optimizer_cpu_offload", "optimizer_offload_fraction", "overlap_cpu_optimizer_d2h_h2d")},
        f"{p}.override_optimizer_config.use_precision_aware_optimizer": no_effect(
            "a memory layout only while the gradient and moment dtypes are fp32, as they always are here"),
    }


def role_keys(role: str) -> dict[str, Rule]:
    """verl's keys of a Megatron role's section (`actor_rollout_ref.actor`, `critic`) that polyturn does not have."""
    return {
        f"{role}.rollout_n": Rule(f"verl copies {ROLLOUT}.n; drop the key", same_as=f"{ROLLOUT}.n"),
        f"{role}.shuffle": only("mini-batches are taken in the batch's order (verl's default); drop the key",
                                   False),
        f"{role}.data_loader_seed": no_effect("read only with shuffle=True (refused here)"),
        f"{role}.checkpoint.save_contents": no_effect(_CHECKPOINT, _DEFAULT_CONTENTS),
        f"{role}.checkpoint.load_contents": no_effect("a resume loads everything saved", _DEFAULT_CONTENTS),
        f"{role}.checkpoint.async_save": no_effect("checkpoints are saved synchronously", False),
        f"{role}.checkpoint.strict": no_effect("checkpoints load strictly here (a mismatch stops the run)", True),
        f"{role}.checkpoint.mbridge_config": no_effect(_ADAPTERS),
        f"{role}.fsdp_config": no_effect(_FSDP.format(role)),
        f"{role}.profiler": PROFILER,
        f"{role}.strategy": only("polyturn trains with Megatron only; drop the key", "megatron"),
        **_megatron(role, trains=True), **_optim(role), **_model(f"{role}.model" if role == CRITIC else MODEL),
    }


def _model(p: str) -> dict[str, Rule]:
    """verl's `<role>.model.*` keys that polyturn does not have (the policy's and the critic's alike)."""
    lora_off = no_effect("read only with LoRA (model.lora_rank > 0), which is not built")
    no_lora = "LoRA is not built: polyturn trains every weight; drop the key"
    no_mtp = "multi-token prediction is not built (no MTP head, no speculative decoding); drop the key"
    return {
        f"{p}.hf_config_path": only(f"the model config is read from {MODEL}.path; put it there", None),
        f"{p}.tokenizer_path": only(f"the tokenizer is read from {MODEL}.path; put it there", None),
        f"{p}.use_shm": no_effect("verl's copy of the checkpoint into shared memory (load speed)", False),
        **({} if p == MODEL else {f"{p}.trust_remote_code": Rule(
            f"the value model is built from the policy's checkpoint, read with {MODEL}.trust_remote_code; set that",
            same_as=f"{MODEL}.trust_remote_code")}),
        f"{p}.custom_chat_template": only(f"the chat template of {MODEL}.path's tokenizer is used; put the "
                                             "template in its tokenizer_config.json", None),
        f"{p}.external_lib": only("models are built by polyturn's adapters, not transformers' registry; drop the "
                                     "key", None),
        f"{p}.override_config": only(f"HF config overrides are not built; edit the checkpoint's config.json or set "
                                        f"Megatron fields in {ACTOR}.megatron.override_transformer_config", {}),
        f"{p}.enable_activation_offload": no_effect(f"a memory knob; activation recompute is "
                                                f"{MODEL}.enable_gradient_checkpointing", False),
        f"{p}.lora_rank": only(no_lora, 0),
        f"{p}.lora_adapter_path": only(no_lora, None),
        **{f"{p}.{k}": lora_off for k in ("lora_alpha", "target_modules", "exclude_modules")},
        f"{p}.lora.rank": only(no_lora, 0),
        f"{p}.lora.adapter_path": only(no_lora, None),
        f"{p}.lora": lora_off,
        f"{p}.use_liger": no_effect("verl's Liger kernels (speed)", False),
        f"{p}.use_fused_kernels": no_effect("verl's fused log-prob kernels; log-probs are computed in fp32 here", False),
        f"{p}.fused_kernel_options": no_effect("read only with use_fused_kernels"),
        f"{p}.tiled_mlp": no_effect("a memory knob of verl's _FSDP path"),
        f"{p}.use_remove_padding": no_effect(_PACKED, True),
        **{f"{p}.mtp.{k}": only(no_mtp, False) for k in ("enable", "enable_train", "enable_rollout")},
        f"{p}.mtp": no_effect("read only with mtp.enable=True (refused here)"),
    }


def ref_keys() -> dict[str, Rule]:
    """verl's `actor_rollout_ref.ref.*` keys: the reference is the actor's model, forward-only, in its own layout."""
    m = f"{REF}.megatron"
    return {
        **_megatron(REF, trains=False),
        **{f"{m}.{k}": Rule(f"{why}: it must equal {ACTOR}.megatron.{k}; set that instead",
                            same_as=f"{ACTOR}.megatron.{k}") for k, why in _REF_AS_ACTOR.items()},
        **{f"{m}.{k}": no_effect(f"every role is offloaded with the actor's flags ({ACTOR}.megatron.{k}): memory "
                                 "only", False) for k in ("param_offload", "grad_offload", "optimizer_offload")},
        f"{m}.context_parallel_size": only(f"{_NO_CP}; drop the key (or set 1)", 1),
        f"{m}.seed": no_effect("the reference is seeded by trainer.seed"),
        f"{m}.use_distributed_optimizer": no_effect("the reference has no optimizer"),
        f"{REF}.log_prob_micro_batch_size": only(f"give the per-GPU size {REF}.log_prob_micro_batch_size_per_gpu "
                                                    "instead"),
        f"{REF}.rollout_n": Rule(f"verl copies {ROLLOUT}.n; drop the key", same_as=f"{ROLLOUT}.n"),
        f"{REF}.strategy": only("polyturn trains with Megatron only; drop the key", "megatron"),
        f"{REF}.use_torch_compile": no_effect("verl's torch.compile of its log-prob helpers (speed)"),
        **{f"{REF}.{k}": no_effect("a memory knob of verl's entropy computation")
           for k in ("entropy_from_logits_with_chunking", "entropy_from_logits_chunk_size")},
        f"{REF}.fsdp_config": no_effect(_FSDP.format(REF)),
        f"{REF}.profiler": PROFILER,
        f"{REF}.router_replay": _NO_REPLAY,
    }


def actor_keys() -> dict[str, Rule]:
    """verl's `actor_rollout_ref.actor.*` keys beyond a role's: the policy loss's and the actor's own."""
    return {
        f"{ACTOR}.megatron.seed": Rule("Megatron's RNG is seeded by trainer.seed (with the data order and sampling): "
                                       "set trainer.seed", rename="trainer.seed"),
        f"{ACTOR}.megatron.context_parallel_size": only(
            f"{_NO_CP}; drop the key (or set 1) and use tensor_model_parallel_size", 1),
        f"{ACTOR}.megatron.use_distributed_optimizer": Rule(
            "Megatron's distributed optimizer", rename=f"{ACTOR}.optim.use_distributed_optimizer"),
        f"{ACTOR}.ppo_micro_batch_size": only(f"give the per-GPU size {ACTOR}.ppo_micro_batch_size_per_gpu instead"),
        f"{ACTOR}.clip_ratio": no_effect(f"verl reads it only where clip_ratio_low / clip_ratio_high are null, and they "
                                     f"never are; set {ACTOR}.clip_ratio_low and {ACTOR}.clip_ratio_high", 0.2),
        **{f"{ACTOR}.{k}": no_effect("SAPO's temperature, read only by policy_loss.loss_mode=sapo (refused here)")
           for k in ("tau_pos", "tau_neg")},
        f"{ACTOR}.policy_loss.dro_beta": no_effect("read only by verl's DRO loss mode (refused by policy_loss.loss_mode "
                                               "here)", None),
        f"{ACTOR}.freeze_vision_tower": no_effect("polyturn trains text-only models", False),
        f"{ACTOR}.calculate_entropy": no_effect("verl's switch to compute entropy for its metrics", False),
        f"{ACTOR}.calculate_sum_pi_squared": no_effect("verl's sum-of-squared-probabilities statistic for its "
                                                   "optimal-token-baseline estimator (not an estimator here)", False),
        f"{ACTOR}.use_prefix_grouper": no_effect("verl's shared-prefix forward (speed)", False),
        f"{ACTOR}.use_torch_compile": no_effect("verl's torch.compile of its log-prob helpers (speed)"),
        f"{ACTOR}.use_fused_kernels": no_effect("verl's fused log-prob kernels; log-probs are computed in fp32 here",
                                            False),
        **{f"{ACTOR}.{k}": no_effect("a memory knob of verl's entropy computation")
           for k in ("entropy_from_logits_with_chunking", "entropy_from_logits_chunk_size")},
        f"{ACTOR}.router_replay": _NO_REPLAY,
        f"{ACTOR}.qat.enable": _NO_QAT,
        f"{ACTOR}.qat": _QAT_OFF,
        f"{ACTOR}.use_rollout_log_probs": only(
            "old log-probs are always recomputed by the trainer, and the engine's are used through "
            "algorithm.rollout_correction.*; drop the key", False),
        f"{ROLLOUT}.log_prob_micro_batch_size": only(
            f"give the per-GPU size {ROLLOUT}.log_prob_micro_batch_size_per_gpu instead"),
        **{f"{ROLLOUT}.{k}": Rule(f"the actor's old-log-prob pass size: {ACTOR}.{k}", rename=f"{ACTOR}.{k}")
           for k in ("log_prob_micro_batch_size_per_gpu", "log_prob_use_dynamic_bsz", "log_prob_max_token_len_per_gpu")},
        "actor_rollout_ref.nccl_timeout": Rule("the collectives' timeout", rename="trainer.collective_timeout_s"),
    }


def critic_keys() -> dict[str, Rule]:
    """verl's `critic.*` keys beyond a role's."""
    return {
        f"{CRITIC}.ppo_micro_batch_size": only(f"give the per-GPU size {CRITIC}.ppo_micro_batch_size_per_gpu "
                                                  "instead"),
        f"{CRITIC}.model.path": Rule(f"the critic is built from the policy's checkpoint: it must equal {MODEL}.path; "
                                     "drop the key", same_as=f"{MODEL}.path"),
        f"{CRITIC}.megatron.context_parallel_size": only(f"{_NO_CP}; drop the key (or set 1)", 1),
        f"{CRITIC}.megatron.seed": no_effect("the critic is seeded by trainer.seed"),
        f"{CRITIC}.megatron.use_distributed_optimizer": Rule(
            "Megatron's distributed optimizer", rename=f"{CRITIC}.optim.use_distributed_optimizer"),
        f"{CRITIC}.forward_max_token_len_per_gpu": Rule(
            "the value pass's token budget", rename=f"{CRITIC}.log_prob_max_token_len_per_gpu"),
        f"{CRITIC}.enable": only("the critic is built exactly when algorithm.adv_estimator needs values (gae); "
                                    "drop the key", None),
        f"{CRITIC}.nccl_timeout": no_effect("every role's collectives time out after trainer.collective_timeout_s"),
    }


"""Names that code outside this repository reads by name, for vulture (tests/test_dead_code.py); never imported.

Each entry says who reads it. Add a name here only for such a reader; code that nothing calls is removed instead.
Vulture counts any mention below as a use (`_.name`: an attribute or method, a bare name: a function, class,
variable or argument).
"""
# ruff: noqa
# fmt: off

# Megatron-Core reads these configuration attributes and layer-spec submodules, which the workers set
# (megatron_workers/runner.py, model.py).
_.finalize_model_grads_func
_.no_sync_func
_.variable_seq_lengths
_.batch_p2p_comm
_.overlap_p2p_comm
_.microbatch_group_size_per_vp_stage
_.input_layernorm
_.pre_mlp_layernorm
_.q_layernorm
_.k_layernorm
_.core_attention
# Megatron and torch read what the CPU adapter patches onto their modules (megatron_workers/cpu_compat.py).
_.__getattr__
_._get_cuda_rng_state
_._set_cuda_rng_state
_.clip_grad_by_total_norm_fp32
# Megatron calls these with arguments the workers do not use: the attention module's constructor
# (attention.py), the output layer's forward (actor.py, critic.py), finalize_model_grads (runner.py).
attention_type
attn_mask_type
cp_comm_type
pg_collection
runtime_gather_output
num_tokens

# Ray: methods the driver calls on worker actors by name (MegatronWorkerGroup.call_all / dispatch).
_.load_checkpoint      # megatron_workers/runner.py (recipe/trainer.py resume)
_.compute_values       # megatron_workers/critic.py
_.update_critic        # megatron_workers/critic.py
_.update_sft_peak      # benchmarks/train_step.py
_.weight_sync_endpoint  # megatron_workers/actor.py (MegatronWorkerGroup.weight_sync_endpoints)

# The advantage estimators, loaded by dotted path from their registry (recipe/algos/registry.py).
gae
grpo
rloo
reinforce_plus_plus
reinforce_plus_plus_baseline
remax

# The policy-loss modes, loaded by dotted path from their registry (recipe/algos/registry.py POLICY_LOSSES).
vanilla
gspo
gpg
clip_cov
kl_cov
geo_mean

# Plug-in loading by dotted path from YAML (rollout/plugins.py, tool_configs/) and verl's plug-in surface
# (rollout/plugins.py aliases verl.tools.schemas.* to rollout.tools.schemas.*).
Gsm8kTool
MCPTool
SandboxFusionTool
Gsm8kTutorInteraction
_.calculate_score          # an interaction's methods, called by name (rollout/interactions/registry.py)
_.finalize_interaction
OpenAIFunctionToolCall
_.from_openai_function_parsed_schema
_.is_empty
_.is_text_only
function_tool              # users' function-tool files decorate with it (verl.tools.function_tool.function_tool)

# pydantic reads these by name (rollout/tools/schemas.py): the model config and a validator.
model_config
_._media_are_lists

# SGLang: the plug-in entry point (pyproject.toml `sglang.srt.plugins`), a fake kernel registered with
# `register_fake` (named `_`), and a replacement for SGLang's batch-invariant mode called with its arguments
# (rollout/sglang_cpu.py).
sglang_plugin
_
model_runner

# The tokenizers library reads these attributes of the tiny tokenizer (recipe/tiny_model.py).
_.normalizer
_.pre_tokenizer
_.post_processor

# Dataclass fields read through asdict / JSON or by the tests (check_parity.py's report, the trajectory record).
max_abs_logit_diff
max_abs_logprob_diff
roundtrip_exact
sample_index

# Seams the tests use to observe processes (rollout/tools/sandbox_pool.py).
_.idle_pids
# asyncio keeps only weak references to tasks: recipe/engine_faults.py holds the rollout's abort task so the event
# loop does not drop it before it runs.
_._aborting

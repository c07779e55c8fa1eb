"""The rollout's config section, `actor_rollout_ref.rollout.*`: plain dataclasses, no SGLang import.

`recipe.config_schema` uses `RolloutConfig` as that section as it is, and the agent loop and
the engines read it as they are given it. Field names are verl's.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

TRUNCATE_SIDES = ("left", "right", "middle")

# The tool-call formats of SGLang's FunctionCallParser (sglang 0.5.23); listed here so that
# validating a config imports no SGLang. tests/test_config.py checks it against SGLang's own list.
TOOL_CALL_FORMATS = (
    "apertus2509", "beam", "cohere_command4", "deepseekv3", "deepseekv31", "deepseekv32", "deepseekv4", "deepseekv41",
    "dots", "gemma4", "gigachat3", "gigachat35", "glm", "glm45", "glm47", "gpt-oss", "hermes", "hunyuan", "inkling",
    "interns1", "iquest_q1", "k2_horizon", "kimi_k2", "kimi_k3", "lfm2", "ling3", "llama3", "mimo", "minicpm5",
    "minimax-m2", "minimax-m3", "mistral", "muse", "nanbeige", "poolside_v1", "pythonic", "qwen", "qwen25",
    "qwen3_coder", "response_template", "spark25", "step3", "step3p5", "trinity",
)


@dataclass
class MultiTurnConfig:
    """`actor_rollout_ref.rollout.multi_turn.*`: turn limits, tool-call format, plug-in configs."""

    enable: bool = True
    """verl's switch. true: the agent loop's multi-turn rollout with the configured tools and interactions;
    false: single turn (the tool and interaction configs are not loaded, data rows' tools_kwargs and
    interaction_kwargs are ignored)."""
    max_assistant_turns: int | None = None
    """Most assistant (policy) turns per trajectory; a turn that wants to go on past it ends with `max_turns`. None
    (verl's default): no limit, the response budget (`response_length`) ends the trajectory."""
    max_user_turns: int | None = None
    """Most simulated-user (interaction) turns per trajectory. None (verl's default): no limit but the response
    budget and the interaction's own end."""
    max_parallel_calls: int = 1
    """Tool calls of one turn running at once (the rest wait; none is dropped)."""
    max_tool_response_length: int = 256
    """Token budget of one tool response as the model sees it; longer responses are cut."""
    tool_response_truncate_side: str = "middle"
    """Which part of a long tool response is cut: "left" (keep the end), "right" (keep the start), "middle"."""
    format: str = "qwen25"
    """Tool-call format, a name known to SGLang's FunctionCallParser ("qwen25", "hermes", ...)."""
    tool_config_path: str | None = None
    """YAML of the tools (verl format); None: no tools."""
    function_tool_path: str | None = None
    """Python file of `@function_tool` functions, each a tool (verl's key; `rollout.tools.function_tool`), with
    the tool YAML's tools if both are set; None: none."""
    interaction_config_path: str | None = None
    """YAML of the interactions (verl format); None: no interactions."""

    def __post_init__(self) -> None:
        p = "actor_rollout_ref.rollout.multi_turn"
        for key in ("max_parallel_calls", "max_tool_response_length"):
            if getattr(self, key) < 1:
                raise ValueError(f"{p}.{key} is {getattr(self, key)}; it must be >= 1")
        for key in ("max_assistant_turns", "max_user_turns"):  # verl reads 0 as no limit: refused, not reinterpreted
            if getattr(self, key) is not None and getattr(self, key) < 1:
                raise ValueError(f"{p}.{key} is {getattr(self, key)}; use a turn count >= 1, or null for no limit")
        if self.tool_response_truncate_side not in TRUNCATE_SIDES:
            raise ValueError(f"{p}.tool_response_truncate_side={self.tool_response_truncate_side!r}; "
                             f"use one of {TRUNCATE_SIDES}")
        if self.format not in TOOL_CALL_FORMATS:
            raise ValueError(f"{p}.format={self.format!r} is not a SGLang tool-call parser; "
                             f"use one of {TOOL_CALL_FORMATS}")


# What a data row's `agent_name` (verl's) may name: the multi-turn loop with the sample's tools and interaction, or
# one assistant turn with no tools and no simulated user (verl's `single_turn_agent`).
AGENT_LOOPS = ("tool_agent", "single_turn_agent")


@dataclass
class AgentConfig:
    """`actor_rollout_ref.rollout.agent.*` (verl's section; its worker knobs have no effect here)."""

    default_agent_loop: str = "tool_agent"
    """The agent loop of rows without `agent_name`: "tool_agent" (the multi-turn loop with tools and interactions)
    or "single_turn_agent" (one turn, no tools). verl's default is single_turn_agent; polyturn's keeps its rows'
    tools on."""

    def __post_init__(self) -> None:
        if self.default_agent_loop not in AGENT_LOOPS:
            raise ValueError(f"actor_rollout_ref.rollout.agent.default_agent_loop={self.default_agent_loop!r} is not "
                             f"an agent loop polyturn runs; use one of {AGENT_LOOPS}")


_R = "actor_rollout_ref.rollout"
_PLACED = "the placement (recipe.placement gives each engine its GPUs: tensor_model_parallel_size of one node)"
SGLANG_OWNED = {
    "model_path": "actor_rollout_ref.model.path", "tokenizer_path": "actor_rollout_ref.model.path",
    "trust_remote_code": "actor_rollout_ref.model.trust_remote_code", "tp_size": f"{_R}.tensor_model_parallel_size",
    "dtype": f"{_R}.dtype", "mem_fraction_static": f"{_R}.gpu_memory_utilization",
    "max_total_tokens": f"{_R}.max_total_tokens", "enable_deterministic_inference": f"{_R}.deterministic",
    "random_seed": "trainer.seed (engine i samples with trainer.seed + i)",
    **dict.fromkeys(("base_gpu_id", "gpu_id_step", "dp_size", "pp_size", "ep_size", "nnodes", "node_rank",
                     "dist_init_addr"), _PLACED),
    **dict.fromkeys(("port", "nccl_port"), "free ports of their own (several engines share a node)"),
    "weight_version": "the weight sync (the trainer's version)",
    "enable_memory_saver": "the placement (on exactly when the engines share GPUs with the trainer)",
}
"""SGLang `ServerArgs` that polyturn sets itself, and from what; `engine_kwargs.sglang` may not set them."""


@dataclass
class EngineKwargsConfig:
    """`actor_rollout_ref.rollout.engine_kwargs.*` (verl's section): arguments passed to the engines as they are."""

    sglang: dict[str, Any] = field(default_factory=dict)
    """SGLang `ServerArgs` fields every engine starts with (`disable_radix_cache: true`, `attention_backend: fa3`,
    ...), on top of polyturn's own; those polyturn sets from its keys (`SGLANG_OWNED`) are refused, and so is a name
    SGLang's ServerArgs does not have (checked before Ray)."""

    def __post_init__(self) -> None:
        owned = [k for k in self.sglang if k in SGLANG_OWNED]
        if owned:
            raise ValueError(f"{_R}.engine_kwargs.sglang sets {owned}, which polyturn sets itself: " + "; ".join(
                f"{k} from {SGLANG_OWNED[k]}" for k in owned) + "; drop them (set those keys instead)")


@dataclass
class ValKwargsConfig:
    """`actor_rollout_ref.rollout.val_kwargs.*`: sampling of the validation rollouts (verl's keys)."""

    n: int = 1
    """Samples per validation prompt (metrics are reported `@n`); do_sample=false rolls out each prompt once."""
    temperature: float = 0.0
    """Sampling temperature of the validation rollouts (used with do_sample=true)."""
    top_p: float = 1.0
    """Nucleus mass of the validation rollouts (used with do_sample=true)."""
    top_k: int = -1
    """Top-k of the validation rollouts (used with do_sample=true); -1 disables it."""
    do_sample: bool = False
    """false: greedy (temperature 0, one sample per prompt); true: sample with the keys above."""

    def __post_init__(self) -> None:
        p = "actor_rollout_ref.rollout.val_kwargs"
        if self.n < 1:
            raise ValueError(f"{p}.n is {self.n}; it must be >= 1")
        if self.temperature < 0:
            raise ValueError(f"{p}.temperature is {self.temperature}; it must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"{p}.top_p is {self.top_p}; it must lie in (0, 1]")
        if self.n > 1 and not self.do_sample:
            raise ValueError(f"{p}.n is {self.n} with do_sample=false; greedy decoding gives one sample per prompt: "
                             f"set {p}.do_sample=true (with a temperature > 0) or n=1")


@dataclass
class RolloutConfig:
    """`actor_rollout_ref.rollout.*`: the SGLang engines and the agent loop."""

    name: str = "sglang"
    """The inference engine; polyturn drives SGLang only."""
    n: int = 1
    """Samples per prompt (the GRPO group size)."""
    response_length: int = 512
    """Most response tokens per trajectory (sampled + tool + user + template tokens); the YAML sets it to
    data.max_response_length, as verl does."""
    max_model_len: int | None = None
    """Most prompt + response tokens (the engine's context); None: only `response_length` limits."""
    temperature: float = 1.0
    """Sampling temperature (the actor divides its logits by it too, so log-probs match)."""
    top_p: float = 1.0
    """Nucleus sampling mass."""
    top_k: int = -1
    """Top-k sampling; -1 disables it."""
    tensor_model_parallel_size: int = 1
    """GPUs per engine (SGLang tp_size); there are (GPUs of the engines' pool) / this many engines."""
    dtype: str = "bfloat16"
    """Engine weights dtype ("float32" for exact comparisons on CPU)."""
    gpu_memory_utilization: float = 0.5
    """SGLang mem_fraction_static."""
    max_total_tokens: int | None = None
    """KV-cache size in tokens; None: SGLang sizes it (always set it on CPU)."""
    update_weights_bucket_megabytes: int = 512
    """Weight-sync bucket size."""
    update_weights_mode: str | None = None
    """Weight-sync path (`recipe.weight_sync.PATHS`): "tensor" (hand-over on the engines' GPUs), "distributed"
    (broadcast over a process group), "disk" (HF checkpoint, the fallback); None: tensor with hybrid_engine,
    distributed without."""
    deterministic: bool = False
    """Reproducible rollouts: each trajectory samples with a seed of its own (from trainer.seed, the step and its
    uid; SGLang's `sampling_seed`) on engines started with SGLang's `enable_deterministic_inference`, so its tokens
    do not depend on the requests batched with it, and a resumed run repeats the uninterrupted one. Slower
    (batch-invariant kernels on GPUs; row-by-row matrix products on CPU)."""
    check_weights: bool = False
    """After each sync, compare a checksum per tensor on both sides; a stale or corrupted tensor stops the run."""
    max_engine_restarts: int = 3
    """Restarts allowed per engine over the run: a dead engine (its actor died, or a health probe went unanswered)
    is restarted on its own bundle, synced to the current weights and checked before it serves again; one more
    death stops the run (non-zero exit naming the engine). 0: the first death stops the run."""
    max_trajectory_retries: int = 1
    """Times a trajectory whose engine died is started over on an engine still alive (fresh tool instances and
    interaction); past it, it ends in error."""
    over_sample_rate: float = 0.0
    """verl's over-sampling: once all but this fraction of a training rollout's trajectories have ended, the rest
    (the slowest: long generations, slow tools, long chats) are aborted and not trained on (finish reason
    `over_sampled`; their tools are released and interactions finalized as usual). Cuts the long tail of a
    multi-turn rollout at the cost of that fraction of samples. 0: every trajectory runs to its end. Validation
    and ReMax's greedy baseline always run every trajectory."""
    engine_health_timeout_s: float = 60.0
    """Seconds an engine has to answer the one-token health probe the trainer sends every engine after each
    rollout; past it the engine counts as dead and is restarted."""
    multi_turn: MultiTurnConfig = field(default_factory=MultiTurnConfig)
    """Multi-turn limits, tool-call format and plug-in configs."""
    val_kwargs: ValKwargsConfig = field(default_factory=ValKwargsConfig)
    """Sampling of the validation rollouts (same agent loop, same engines)."""
    agent: AgentConfig = field(default_factory=AgentConfig)
    """Which agent loop rows without `agent_name` get."""
    engine_kwargs: EngineKwargsConfig = field(default_factory=EngineKwargsConfig)
    """Engine arguments passed through (`engine_kwargs.sglang.*`)."""

    def __post_init__(self) -> None:
        p = "actor_rollout_ref.rollout"
        if isinstance(self.multi_turn, dict):
            self.multi_turn = MultiTurnConfig(**self.multi_turn)
        if isinstance(self.val_kwargs, dict):
            self.val_kwargs = ValKwargsConfig(**self.val_kwargs)
        if isinstance(self.agent, dict):
            self.agent = AgentConfig(**self.agent)
        if isinstance(self.engine_kwargs, dict):
            self.engine_kwargs = EngineKwargsConfig(**self.engine_kwargs)
        if self.name != "sglang":
            raise ValueError(f"{p}.name is {self.name!r}; polyturn drives SGLang only: use sglang")
        for key in ("n", "response_length", "tensor_model_parallel_size", "update_weights_bucket_megabytes"):
            if getattr(self, key) < 1:
                raise ValueError(f"{p}.{key} is {getattr(self, key)}; it must be >= 1")
        for key in ("max_engine_restarts", "max_trajectory_retries"):
            if getattr(self, key) < 0:
                raise ValueError(f"{p}.{key} is {getattr(self, key)}; it must be >= 0")
        if not 0.0 <= self.over_sample_rate < 1.0:
            raise ValueError(f"{p}.over_sample_rate is {self.over_sample_rate}; it must lie in [0, 1) (0: off)")
        if self.engine_health_timeout_s <= 0:
            raise ValueError(f"{p}.engine_health_timeout_s is {self.engine_health_timeout_s}; it must be > 0")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"{p}.max_model_len is {self.max_model_len}; it must be >= 2 (or null)")
        if self.temperature < 0:
            raise ValueError(f"{p}.temperature is {self.temperature}; it must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"{p}.top_p is {self.top_p}; it must lie in (0, 1]")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"{p}.gpu_memory_utilization is {self.gpu_memory_utilization}; it must lie in (0, 1]")

"""Every config key: its type, its default (written here once) and, in the string under it, its meaning.

ppo.py reads `Config`, reward_model.py `RewardModelStage`; they share the LoRA and run fields. configs.yaml is
generated from these dataclasses (`python tools/configs_yaml.py > configs.yaml`, every key with its documentation as a
comment); cli.py reads a YAML file and dotted overrides into them and checks every value (types, RANGES). At the end:
the batch sizes ppo.py derives (check_sizes) and the settings that cannot work together (check_combinations).
"""
import importlib.util
import re
from dataclasses import dataclass, field
from typing import Literal, Optional


@dataclass
class LoRAFields:
    lora_rank: int = 32
    """LoRA rank; 0 trains all weights"""
    lora_alpha: int = 64
    """LoRA scaling numerator (scale = alpha / rank)"""
    lora_dropout: float = 0.0
    """dropout on the LoRA branch"""
    target_modules: list[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj",
                                                               "gate_proj", "up_proj", "down_proj"])
    """module names that get LoRA adapters"""
    lora_top_layers: int = 8
    """LoRA only in the last N decoder layers (0 = all); the backward pass then stops below them"""


@dataclass
class ModelFolderFields:
    trust_remote_code: bool = False
    """run Python code that a model folder ships (an `auto_map` in its config.json or tokenizer_config.json) when
    loading its model, tokenizer or config (ppo.py: policy, reference, critic and reward model; reward_model.py:
    the backbone). false: a folder that needs such code is refused, in one sentence, before anything loads"""


@dataclass
class ModelConfig(LoRAFields, ModelFolderFields):
    path: str = "models/SmolLM2-135M-Instruct"
    """policy checkpoint: a local folder or a hub id (the demo model is made by tools/prepare_model.py)"""
    tokenizer_path: Optional[str] = None
    """tokenizer folder; null means `path`"""
    dtype: Literal["auto", "bf16", "fp32"] = "auto"
    """compute dtype of training forwards: bf16 = autocast over fp32 master weights; auto = bf16 where the
    hardware runs it fast (CUDA, or a CPU with native bf16), else fp32"""
    gradient_checkpointing: bool = False
    """recompute activations in the backward pass to save memory"""
    use_remove_padding: bool = False
    """pack training forwards into one row without padding, each distinct prompt once (layouts.packed_inputs)"""
    share_prompt_prefix: bool = True
    """without packing: run each distinct prompt of a micro-batch once and let its n responses attend to
    its KV cache (policy, reference and critic forwards; not with gradient checkpointing or FSDP)"""
    share_trunk: bool = True
    """with LoRA on the top lora_top_layers layers only: run the frozen layers below them once per step, and start
    the reference, old-logprob, value and update forwards above them; a critic on model.path with LoRA then holds
    only those top layers and its head, not a second copy of the base (infra/trunk.py)"""


@dataclass
class DataConfig:
    train_files: str = "data/arithmetic/train.parquet"
    """training parquet (columns: prompt, and optionally ground_truth, data_source; or verl's layout)"""
    val_files: Optional[str] = "data/arithmetic/val.parquet"
    """validation parquet; null disables validation"""
    train_batch_size: int = 4
    """prompts per step, over all processes"""
    max_prompt_length: int = 128
    """longest prompt in tokens, after the chat template"""
    truncation: Literal["error", "left", "filter"] = "error"
    """what to do with a longer prompt: fail, keep its last tokens, or drop the row"""
    shuffle: bool = True
    """reshuffle the prompts every epoch"""
    val_max_samples: int = 200
    """validate on at most this many rows (0 = all)"""


@dataclass
class MultiTurnConfig:
    enable: bool = False
    """multi-turn rollouts (agent.py): a response is up to max_turns assistant turns, with the answers of the tools
    the model called between them (response_mask 0 on those tokens)"""
    max_turns: int = 2
    """most assistant turns per response; a turn ends at EOS, and the calls written in it are run before the next"""
    tools: list[str] = field(default_factory=list)
    """the tools, each path/to/file.py:function; the model calls a tool by the function's name"""
    format: str = "hermes"
    """how a call is written, a name in agent.PARSERS: hermes (<tool_call>{"name": …, "arguments": {…}}</tool_call>,
    as Qwen2.5 and verl) or tag (<name>text</name>: the function gets the text)"""
    tool_timeout_s: float = 5.0
    """seconds a tool call may take; a slower one is answered with an error (its thread is left behind)"""
    max_tool_response_length: int = 256
    """characters of a tool's answer the model sees (verl's key); the rest is cut and marked ...(truncated)"""


@dataclass
class RolloutConfig:
    name: Literal["vllm", "hf"] = "vllm"
    """generation backend; falls back to hf (with a warning) where vLLM cannot be imported"""
    n: int = 8
    """samples per prompt"""
    temperature: float = 1.0
    """sampling temperature"""
    top_p: float = 1.0
    """nucleus sampling mass (1 = off)"""
    top_k: int = -1
    """sample among the k likeliest tokens (-1 = off)"""
    max_response_length: int = 16
    """most tokens per response (multi-turn: every turn and tool answer of it together)"""
    val_temperature: float = 0.0
    """temperature for validation (0 = greedy)"""
    val_n: int = 1
    """samples per validation prompt (verl's val_kwargs.n); above 1 (with val_temperature > 0) validation logs
    mean@k, unbiased pass@k and, where the rule names its answer, maj@k per data_source (Scorer.validation_metrics)"""
    gpu_memory_utilization: float = 0.2
    """vLLM's memory share for weights and KV cache (on CPU, a share of host RAM)"""
    enforce_eager: bool = True
    """vLLM: no CUDA graphs"""
    dtype: Literal["auto", "bf16", "fp32"] = "auto"
    """vLLM weights dtype; auto = the dtype model.dtype resolves to (so model.dtype=fp32 samples in fp32 too)"""
    free_cache_engine: bool = False
    """vLLM on GPU: sleep the engine (free its KV cache) while training"""
    micro_batch_size: int = 64
    """sequences per HF generate call"""
    ignore_eos: bool = False
    """keep generating past EOS to max_response_length (fixed-length responses, for benchmarks)"""
    vllm_log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "WARNING"
    """vLLM's own logging (INFO prints its engine set-up); the environment's VLLM_LOGGING_LEVEL wins when set"""
    multi_turn: MultiTurnConfig = field(default_factory=MultiTurnConfig)
    """tool calls between assistant turns (agent.py)"""


@dataclass
class KLControlConfig:
    type: Literal["fixed", "adaptive"] = "fixed"
    """fixed β, or adaptive β (Ziegler et al. 2019)"""
    kl_coef: float = 0.001
    """β, the initial KL-penalty coefficient"""
    target_kl: float = 0.1
    """adaptive controller: KL per sequence it steers towards"""
    horizon: int = 10000
    """adaptive controller: horizon in samples"""


@dataclass
class FilterGroupsConfig:
    enable: bool = False
    """DAPO's dynamic sampling (Yu et al., 2025; verl's algorithm.filter_groups): drop the prompts whose rollout.n
    scores are all equal (no advantage to learn from) and generate for more prompts until the step has
    data.train_batch_size of them; each process fills its own share"""
    max_num_gen_batches: int = 10
    """most generate rounds of data.train_batch_size prompts per step, the first included; a step still short after
    them stops the run with the counts (verl's key; its 0 = unbounded has no equivalent here)"""


@dataclass
class AlgorithmConfig:
    adv_estimator: str = "gae"
    """advantage estimator, a name in advantages.ESTIMATORS: gae (with the critic), grpo (group-normalised), rloo
    (leave-one-out), reinforce_plus_plus (discounted return per token, whitened over the global batch),
    reinforce_plus_plus_baseline (the score minus its group's mean, whitened over the global batch)"""
    gamma: float = 1.0
    """discount factor for GAE and REINFORCE++"""
    lam: float = 0.95
    """GAE λ"""
    norm_adv_by_std_in_grpo: bool = True
    """GRPO: divide by the group std (false = Dr. GRPO)"""
    whiten_advantages: bool = True
    """GAE: whiten advantages over the valid tokens of the batch"""
    use_kl_in_reward: bool = False
    """subtract β·KL(policy‖ref) from the per-token reward"""
    kl_penalty: str = "k1"
    """KL estimator for the reward penalty, a name in kl.ESTIMATORS"""
    kl_ctrl: KLControlConfig = field(default_factory=KLControlConfig)
    """controller for β"""
    use_kl_loss: bool = True
    """add kl_loss_coef·KL(policy‖ref) to the policy loss (as GRPO does)"""
    kl_loss_coef: float = 0.1
    """weight of the KL loss"""
    kl_loss_type: str = "k3"
    """KL estimator for the KL loss, a name in kl.ESTIMATORS"""
    filter_groups: FilterGroupsConfig = field(default_factory=FilterGroupsConfig)
    """dynamic sampling"""
    rollout_is: Literal["off", "token", "sequence", "sequence_mean"] = "off"
    """truncated importance sampling for the sampler/trainer gap (needs the sampler's logprobs: rollout.name=vllm):
    the policy loss × min(ρ, rollout_is_threshold), ρ = π_old/π_rollout per token, per response (the product), or
    per response length-normalised (the geometric mean); off still logs the token weights"""
    rollout_is_threshold: float = 2.0
    """upper bound of the rollout importance weight"""
    rollout_rs: Literal["off", "token", "sequence", "sequence_mean"] = "off"
    """rollout rejection sampling (verl's rollout_rs token_k1 / seq_sum_k1 / seq_mean_k1; needs rollout.name=vllm):
    a token, or a whole response, whose ratio ρ (as rollout_is) leaves [rollout_rs_threshold_lower,
    rollout_rs_threshold] is left out of the policy loss"""
    rollout_rs_threshold: float = 2.0
    """upper bound of ρ kept by rejection"""
    rollout_rs_threshold_lower: float = 0.0
    """lower bound of ρ kept by rejection; 0 = 1 / rollout_rs_threshold (as verl)"""


@dataclass
class OptimConfig:
    lr: float = 1e-4
    """peak learning rate"""
    weight_decay: float = 0.0
    """AdamW weight decay"""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    """AdamW betas"""
    warmup_ratio: float = 0.05
    """share of total steps spent in linear warmup"""
    lr_scheduler: Literal["cosine", "constant"] = "cosine"
    """schedule after warmup"""
    min_lr_ratio: float = 0.1
    """cosine floor, as a share of lr"""


@dataclass
class ActorConfig:
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr_scheduler="constant"))
    """actor optimiser"""
    ppo_epochs: int = 1
    """passes over each batch of rollouts"""
    ppo_mini_batch_size: int = 4
    """prompts per optimiser step, over all processes (times rollout.n sequences)"""
    ppo_micro_batch_size_per_device: int = 64
    """sequences per forward/backward on one process (gradient accumulation fills the mini-batch)"""
    log_prob_micro_batch_size_per_device: int = 64
    """sequences per no-grad forward for old/ref logprobs and values"""
    policy_loss: str = "vanilla"
    """the per-token policy loss, a name in losses.POLICY_LOSSES: vanilla (PPO's clipped surrogate), gspo (one
    length-normalised ratio per response, Zheng et al. 2025), cispo (clipped, stop-gradient importance weight,
    MiniMax-M1)"""
    clip_ratio_low: float = 0.2
    """PPO clip: ratio ≥ 1 − clip_ratio_low (1: no lower bound, as CISPO)"""
    clip_ratio_high: float = 0.2
    """PPO clip: ratio ≤ 1 + clip_ratio_high"""
    clip_ratio_c: float = 3.0
    """dual-clip bound for negative advantages (Ye et al., 2020)"""
    entropy_coef: float = 0.0
    """entropy bonus weight"""
    loss_agg_mode: Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean",
                           "seq-mean-token-sum-norm"] = "token-mean"
    """how per-token losses are averaged over the mini-batch (seq-mean-token-sum-norm: Dr. GRPO's sum over
    tokens / (sequences × loss_scale_factor))"""
    loss_scale_factor: float = 0.0
    """the constant normaliser of seq-mean-token-sum-norm (verl's key); 0 = rollout.max_response_length"""
    max_grad_norm: float = 1.0
    """gradient clipping norm"""
    use_dynamic_bsz: bool = False
    """form micro-batches by a token budget instead of a count"""
    max_token_len_per_device: int = 8192
    """token budget per micro-batch when use_dynamic_bsz"""


@dataclass
class CriticConfig:
    model_path: Optional[str] = None
    """value model backbone; null means model.path (a reward-model folder works too)"""
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-4, warmup_ratio=0.0,
                                                                   lr_scheduler="constant", min_lr_ratio=0.0))
    """critic optimiser"""
    cliprange_value: float = 0.2
    """value clipping around old values"""
    vf_coef: float = 1.0
    """value loss weight"""
    warmup_steps: int = 0
    """steps during which only the critic trains"""
    max_grad_norm: float = 1.0
    """clip the critic's gradient norm"""
    ppo_micro_batch_size_per_device: int = 64
    """sequences per critic forward/backward on one process"""
    lora_rank: int = 32
    """LoRA rank of the critic (on model.target_modules of the top model.lora_top_layers layers; the value head
    trains whole); 0 trains every weight"""
    lora_alpha: int = 64
    """critic LoRA scaling α (the update is α/r · B·A)"""


@dataclass
class JudgeConfig:
    base_url: Optional[str] = None
    """the judge's OpenAI-compatible endpoint, e.g. http://127.0.0.1:8000/v1 (vLLM's server); asked before any model
    loads"""
    model: Optional[str] = None
    """the model to ask there; null = the one the endpoint serves"""
    api_key_env: str = "OPENAI_API_KEY"
    """environment variable holding the endpoint's API key (a local vLLM server needs none), so no key is saved
    in the run's config.yaml"""
    prompt_template: Optional[str] = None
    """text file with the judge's prompt; {prompt}, {response} and {ground_truth} in it are replaced"""
    parser: str = "number"
    """how an answer becomes a score, a name in judge.PARSERS: number (its last number, in [min_score, max_score],
    scaled to [0, 1]) or yes_no (its last yes or no: 1 or 0)"""
    min_score: float = 0.0
    """number parser: the lowest score the prompt asks for"""
    max_score: float = 10.0
    """number parser: the highest score the prompt asks for"""
    max_tokens: int = 64
    """longest answer of the judge, in tokens"""
    temperature: float = 0.0
    """the judge's sampling temperature"""
    max_concurrency: int = 8
    """requests in flight at once"""
    timeout_s: float = 30.0
    """seconds one request may take before it is retried"""
    max_retries: int = 2
    """retries of a request that timed out, could not connect or got a 429/5xx, after backoff_s, 2·backoff_s, …
    seconds"""
    backoff_s: float = 1.0
    """seconds before the first retry"""
    weight: float = 1.0
    """weight of the judge's score when type=rule+judge"""


@dataclass
class RewardConfig:
    type: Literal["rule", "model", "both", "judge", "rule+judge"] = "rule"
    """score with rule functions, a reward model, a weighted sum of both, an LLM judge (judge.py), or the rule
    and the judge weighted"""
    function: Optional[str] = None
    """custom rule: path/to/file.py:name with verl's compute_score signature; null = built-ins by data_source"""
    model_path: Optional[str] = None
    """reward model folder (AutoModelForSequenceClassification)"""
    rule_weight: float = 1.0
    """weight of the rule score when type=both"""
    model_weight: float = 1.0
    """weight of the model score when type=both"""
    normalize: bool = False
    """standardise model scores with the mean/std stored beside the reward model"""
    clip: Optional[float] = None
    """clip model scores to ±clip"""
    micro_batch_size: int = 32
    """sequences per reward-model forward"""
    overlong_penalty: float = 0.0
    """added to the score of a response that hit max_response_length without EOS"""
    overlong_buffer_len: int = 0
    """DAPO's soft overlong punishment (Yu et al., 2025, eq. 13; verl's reward_manager=dapo overlong_buffer.len):
    a response longer than rollout.max_response_length − this many tokens loses overlong_penalty_factor × the share
    of the buffer it used; 0 = off"""
    overlong_penalty_factor: float = 1.0
    """the soft punishment at a response of rollout.max_response_length tokens"""
    overlong_filter: bool = False
    """DAPO's overlong filtering: responses cut off at max_response_length (no EOS) are left out of the policy loss"""
    timeout_s: float = 30.0
    """seconds one call of a custom reward.function may take: it runs in a worker process, which is restarted after
    a call that hangs, exits or kills it; such a call is an error for its sample (reward/errors)"""
    judge: JudgeConfig = field(default_factory=JudgeConfig)
    """the LLM judge (reward.type=judge or rule+judge)"""


@dataclass
class RunFields:
    total_steps: int = 60
    """training steps (ppo.py: one batch of rollouts each; reward_model.py: one optimiser step each)"""
    output_dir: str = "outputs/ppo"
    """metrics.jsonl, config.yaml, checkpoints, the final model (and for PPO curves.png) go here"""
    seed: int = 1
    """seed for data order, sampling and initialisation"""
    logger: list[str] = field(default_factory=lambda: ["console"])
    """any of console, wandb, tensorboard"""
    project_name: str = "ppo"
    """wandb project"""
    experiment_name: str = "default"
    """wandb run name"""
    save_freq: int = 30
    """checkpoint every N steps (0 = only at the end)"""
    keep_checkpoints: int = 2
    """keep the last N step_* checkpoints"""
    resume: str = "auto"
    """auto (the newest intact checkpoint in output_dir), off, or a checkpoint path"""
    max_skipped_steps: int = 3
    """stop, without writing final/, when this many steps in a row skipped an optimiser step for a non-finite loss
    or gradient: the model is not learning (0 = never stop)"""


@dataclass
class TrainerConfig(RunFields):
    sample_freq: int = 10
    """print a table of sampled responses every N steps (0 = never)"""
    num_samples_to_show: int = 4
    """rows in that table"""
    test_freq: int = 30
    """validate every N steps (0 = only at the end)"""
    val_before_train: bool = True
    """validate once before the first step"""
    max_kl: float = 0.1
    """stop (after a checkpoint) when kl/mean, averaged over the last max_kl_window steps, exceeds this (0 = never)"""
    max_kl_window: int = 10
    """steps averaged by the max_kl guard: one step's estimate from a small batch is noisy (the demo's
    32 samples gave 0.003, 0.16, 0.07 on consecutive steps)"""
    min_entropy: float = 0.0
    """act when policy/entropy falls below this (0 = never)"""
    min_entropy_action: Literal["warn", "stop"] = "warn"
    """what to do then"""
    plot_curves: bool = True
    """write curves.png at the end"""
    best_metric: Optional[str] = None
    """a validation metric (e.g. val/score/mean; higher is better): the checkpoint where it was highest is kept in
    output_dir/best/, which keep_checkpoints never deletes (export it with tools/export.py); null = off"""
    rollback_tolerance: Optional[float] = None
    """when best_metric falls more than this below its best at a validation, restore best/'s weights, optimiser
    states and β and train on from there (the step count, data order and LR schedule go on); null = never"""
    max_rollbacks: int = 3
    """most rollbacks in a run (train/rollbacks counts them)"""


@dataclass
class Config:
    """ppo.py's keys."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """policy model"""
    data: DataConfig = field(default_factory=DataConfig)
    """prompts"""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """generation"""
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    """advantages and KL"""
    actor: ActorConfig = field(default_factory=ActorConfig)
    """policy optimisation"""
    critic: CriticConfig = field(default_factory=CriticConfig)
    """value model (adv_estimator=gae)"""
    reward: RewardConfig = field(default_factory=RewardConfig)
    """scoring"""
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    """loop, logging, checkpoints"""


@dataclass
class RewardModelConfig(LoRAFields, RunFields, ModelFolderFields):
    model_path: str = "models/SmolLM2-135M-Instruct"
    """backbone for the Bradley-Terry reward model: a causal LM folder (a 1-output `score` head is added)"""
    tokenizer_path: Optional[str] = None
    """tokenizer folder; null means model_path. It is saved with the reward model and renders PPO's texts"""
    dtype: Literal["bf16", "fp32"] = "fp32"
    """compute dtype: bf16 = autocast over fp32 master weights (for GPUs; CPUs without native bf16 run it slower)"""
    lora_rank: int = 16
    """LoRA rank; 0 trains all weights (the `score` head is always trained in full)"""
    lora_alpha: int = 32
    train_files: str = "data/preferences/train.parquet"
    """preference parquet: prompt (text or chat messages), chosen, rejected (responses), optional margin"""
    val_files: Optional[str] = "data/preferences/val.parquet"
    """validation preference parquet; null disables validation"""
    val_max_pairs: int = 200
    """validate on at most this many pairs (0 = all)"""
    max_length: int = 96
    """longest conversation in tokens, after the chat template"""
    overlong: Literal["truncate", "drop"] = "truncate"
    """a longer pair: keep its last max_length tokens (the response end, where the reward is read) or drop it"""
    batch_size: int = 16
    """pairs per optimiser step, over all processes"""
    micro_batch_size_per_device: int = 16
    """pairs per forward/backward on one process (2× as many sequences); accumulation fills the batch"""
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=5e-4, warmup_ratio=0.05, min_lr_ratio=0.1))
    """reward-model optimiser"""
    max_grad_norm: float = 1.0
    """gradient clipping norm"""
    margin: bool = True
    """subtract the `margin` column inside the sigmoid, −log σ(r_c − r_r − m) (Llama 2); 0 where absent"""
    center_rewards_coef: float = 0.0
    """weight of (r_chosen + r_rejected)², which keeps rewards centred on 0 (as TRL's RewardTrainer)"""
    output_dir: str = "outputs/reward_model"
    """metrics.jsonl, config.yaml, checkpoints, final/ (merged model, tokenizer, reward_stats.json), final_adapter/"""
    project_name: str = "reward_model"
    eval_freq: int = 20
    """validate every N steps (0 = only at the end)"""
    save_freq: int = 20
    stats_max_pairs: int = 100
    """training pairs scored at the end for reward_stats.json (0 = all)"""


@dataclass
class RewardModelStage:
    """reward_model.py's keys: one section, `reward_model:` in configs.yaml."""
    reward_model: RewardModelConfig = field(default_factory=RewardModelConfig)
    """the Bradley-Terry reward model (reward_model.py)"""


# ---------------------------------------------------------------------------------------
# Loading and checking


class ConfigError(ValueError):
    pass


class SaveError(ConfigError):
    """A file of the run could not be written (disk full, permissions); the message names the folder and what was
    kept."""


def write_error(e: BaseException) -> str:
    """Why a write failed, in a few words: the OS's reason (No space left on device, Permission denied …), also
    from inside safetensors' error ("… I/O error: No space left on device (os error 28)") or torch's checkpoint
    writer (a CheckpointException holding each process's error)."""
    failures = getattr(e, "failures", None)  # torch.distributed.checkpoint.api.CheckpointException
    if failures:
        e = next(iter(failures.values()))[0]
    if isinstance(e, OSError) and e.strerror:
        return e.strerror
    found = re.search(r"I/O error: ([^(]+)", str(e))
    return found.group(1).strip() if found else str(e)[:200]


def exact_div(a: int, b: int, what: str) -> int:
    """a / b as an int, or a sentence saying which batch size does not divide."""
    if b <= 0 or a % b != 0:
        raise ConfigError(f"{what}: {a} is not divisible by {b}")
    return a // b


@dataclass(frozen=True)
class Sizes:
    """Batch sizes derived from the config, computed and checked once (check_sizes); per process unless said."""
    prompts: int  # prompts per step
    batch: int  # B: sequences per step (prompts × rollout.n)
    num_mini: int  # mini-batches (optimiser steps) per PPO epoch, the same on every process
    mini: int  # sequences per mini-batch
    actor_micro: int  # sequences per actor forward/backward (gradient accumulation fills the mini-batch)
    critic_micro: int  # sequences per critic forward/backward


def check_sizes(cfg, world: int, num_rows: int) -> Sizes:
    """ppo.py's derived batch sizes; one that does not divide fails here with a sentence, before any model loads."""
    d, a, n = cfg.data, cfg.actor, cfg.rollout.n
    if num_rows < d.train_batch_size:
        raise ConfigError(f"data.train_files has {num_rows} usable prompts, fewer than "
                          f"data.train_batch_size={d.train_batch_size}")
    prompts = exact_div(d.train_batch_size, world, "data.train_batch_size across processes")
    num_mini = exact_div(d.train_batch_size, a.ppo_mini_batch_size,
                         "data.train_batch_size by actor.ppo_mini_batch_size (prompts per mini-batch)")
    mini = exact_div(a.ppo_mini_batch_size * n, world, "actor.ppo_mini_batch_size × rollout.n across processes")
    actor_micro = min(a.ppo_micro_batch_size_per_device, mini)
    exact_div(mini, actor_micro, "sequences per mini-batch on one process by actor.ppo_micro_batch_size_per_device")
    critic_micro = min(cfg.critic.ppo_micro_batch_size_per_device, mini)
    exact_div(mini, critic_micro, "sequences per mini-batch on one process by critic.ppo_micro_batch_size_per_device")
    return Sizes(prompts, prompts * n, num_mini, mini, actor_micro, critic_micro)


def check_combinations(cfg) -> None:
    """ppo.py's settings that cannot work together fail here, before anything loads, one sentence each."""
    alg, ro, t = cfg.algorithm, cfg.rollout, cfg.trainer
    asked = [f"algorithm.{key}={getattr(alg, key)}" for key in ("rollout_is", "rollout_rs")
             if getattr(alg, key) != "off"]
    if asked and (ro.name == "hf" or importlib.util.find_spec("vllm") is None):
        raise ConfigError(f"{' and '.join(asked)} corrects by the sampler's own logprobs, which only rollout.name=vllm "
                          f"gives ({'rollout.name is hf' if ro.name == 'hf' else 'vLLM is not installed'}); "
                          f"use rollout.name=vllm, or set {' and '.join(a.split('=')[0] for a in asked)} to off")
    if alg.rollout_rs_threshold_lower > alg.rollout_rs_threshold:
        raise ConfigError(f"algorithm.rollout_rs_threshold_lower={alg.rollout_rs_threshold_lower} is above "
                          f"algorithm.rollout_rs_threshold={alg.rollout_rs_threshold}, so rejection would keep nothing")
    if alg.filter_groups.enable and ro.n < 2:
        raise ConfigError(f"algorithm.filter_groups.enable keeps the prompts whose samples score differently: set "
                          f"rollout.n ≥ 2 (it is {ro.n})")
    if ro.val_n > 1 and ro.val_temperature == 0:
        raise ConfigError(f"rollout.val_n={ro.val_n} greedy samples (rollout.val_temperature=0) are one answer "
                          f"{ro.val_n} times: set rollout.val_temperature > 0, e.g. 1.0, or rollout.val_n=1")
    if cfg.reward.overlong_buffer_len > ro.max_response_length:
        raise ConfigError(f"reward.overlong_buffer_len={cfg.reward.overlong_buffer_len} is longer than "
                          f"rollout.max_response_length={ro.max_response_length}: make it at most that")
    if t.best_metric and not cfg.data.val_files:
        raise ConfigError(f"trainer.best_metric={t.best_metric} needs validation: set data.val_files")
    if t.rollback_tolerance is not None and not t.best_metric:
        raise ConfigError("trainer.rollback_tolerance rolls back to the best checkpoint: set trainer.best_metric too "
                          "(e.g. val/score/mean)")



# The range of every number, by field name (a name means the same thing in every section). Any number not
# listed must be ≥ 0. Every number must be finite; a list (betas) is checked element by element.
RANGES = {
    "[1, inf)": "n val_n max_num_gen_batches train_batch_size max_prompt_length max_response_length micro_batch_size "
                "ppo_epochs ppo_mini_batch_size ppo_micro_batch_size_per_device log_prob_micro_batch_size_per_device "
                "max_token_len_per_device horizon total_steps max_kl_window batch_size micro_batch_size_per_device "
                "max_length lora_alpha max_turns max_tool_response_length max_tokens max_concurrency",
    "(0, inf)": "lr target_kl max_grad_norm rollout_is_threshold rollout_rs_threshold clip timeout_s tool_timeout_s",
    "(0, 1]": "top_p gpu_memory_utilization",
    "[0, 1)": "lora_dropout betas",
    "[0, 1]": "gamma lam warmup_ratio min_lr_ratio clip_ratio_low",
    "(1, inf)": "clip_ratio_c",
    "[-1, inf)": "top_k",
    "(-inf, inf)": "rule_weight model_weight overlong_penalty min_score max_score weight",
}
RANGE_OF = {name: interval for interval, names in RANGES.items() for name in names.split()}
# List keys whose length is fixed, by field name: AdamW takes exactly two betas.
LENGTH_OF = {"betas": 2}


# Keys a resumed run must share with the run that wrote the checkpoint: they shape the saved weights (model,
# LoRA) or what a step is (batch sizes, samples per prompt, the advantage estimator and its critic).
FIXED_ON_RESUME = {"model.path", "model.tokenizer_path", "model.lora_rank", "model.lora_alpha", "model.target_modules",
                   "model.lora_top_layers", "data.train_batch_size", "rollout.n", "actor.ppo_mini_batch_size",
                   "algorithm.adv_estimator", "critic.model_path", "reward_model.model_path",
                   "reward_model.tokenizer_path", "reward_model.lora_rank", "reward_model.lora_alpha",
                   "reward_model.target_modules", "reward_model.lora_top_layers", "reward_model.batch_size"}

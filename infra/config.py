"""Every config key: its type, its default (written here once) and, in the string under it, its meaning.

ppo.py reads `Config`, reward_model.py `RewardModelStage`; they share the LoRA and run fields. configs.yaml is
generated from these dataclasses (`python tools/configs_yaml.py > configs.yaml`, every key with its documentation as a
comment); cli.py reads a YAML file and dotted overrides into them and checks every value (types, RANGES). The
algorithm's sections (algorithm, actor, critic, their optimisers, reward) are infra/config_rl.py's; the checks that
need more than one key (batch sizes, settings that only work together) are infra/checks.py's.
"""
import functools
import importlib
from dataclasses import dataclass, field
from typing import Literal, Optional

from infra.config_rl import ActorConfig, AlgorithmConfig, CriticConfig, OptimConfig, RewardConfig


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
    curriculum: Optional[str] = None
    """reasoning-gym's curriculum, a YAML file as its training configs write it (curriculum:, reasoning_gym:): the rows
    are its tasks' entries, at levels that follow each task's accuracy (agents/reasoning_gym.py), not train/val_files"""
    val_reference: Optional[str] = "extra_info.answer"
    """the held-out text of val/perplexity, exp(−mean token log-prob) of the policy over it, each text the response to
    its prompt (its EOS included), at every validation and the one before training (the pre-trained value): a field of
    the validation rows (extra_info.answer: verl's GSM8K rows and the demo's carry a written-out answer; or
    ground_truth), measured on the rows that have it and not logged where none has; or a parquet of preference pairs
    (prompt, chosen: their chosen responses, e.g. data/preferences/val.parquet); null = no val/perplexity"""


@dataclass
class MultiTurnConfig:
    enable: bool = False
    """multi-turn rollouts (agents/multi_turn.py): a response is up to max_turns assistant turns, with the messages of an
    environment (env) or the answers of the tools the model called (tools) between them (response_mask 0 there)"""
    max_turns: int = 2
    """most assistant turns per response; a turn ends at EOS, and the environment answers it before the next"""
    env: str = ""
    """an environment, path/to/file.py:Class (agents/environments.py has the contract: reset(row) gives the first messages,
    step(text) the next ones, a reward at the turn's last token and done; TRL's environment_factory and SkyRL-Gym's
    BaseTextEnv are recognised by their shape, a factory function or a dict of them too: agents/peers.py), or
    verifiers:<path/to/env.py or module>, a verifiers environment (agents/verifiers.py); one instance per sample,
    each in a process of its own. Empty: the built-in environment that runs `tools`"""
    env_column: str = "env_class"
    """where env names a dict of environments ({name: class or factory}, agents/peers.py), the rows' column whose
    value picks each row's (SkyRL-Gym's env_class)"""
    env_timeout_s: float = 30.0
    """seconds an environment's reset or step may take; a slower one, or one that raises or ends its process, ends
    its sample's episode there (counted in agent/env_errors_share), never the run"""
    tools: list[str] = field(default_factory=list)
    """the tools, each path/to/file.py:function; the model calls a tool by the function's name"""
    format: str = "hermes"
    """how a call is written, a name in agents/tools.py's PARSERS: hermes (<tool_call>{"name": …, "arguments": {…}}</tool_call>,
    as Qwen2.5 and verl) or tag (<name>text</name>: the function gets the text)"""
    tool_timeout_s: float = 5.0
    """seconds a tool call may take; each call runs in a process of its own, killed after this (whatever the call is
    doing), and is answered with an error"""
    max_calls_per_turn: int = 8
    """tool calls run per turn; the calls after these are answered with an error, not run"""
    max_tool_response_length: int = 256
    """characters of a tool's answer the model sees (verl's key); the rest is cut and marked ...(truncated)"""


@dataclass
class ServerConfig:
    url: Optional[str] = None
    """rollout.name=server: the OpenAI-compatible vLLM server to use, e.g. http://127.0.0.1:8000 (started with
    VLLM_SERVER_DEV_MODE=1, and VLLM_ALLOW_RUNTIME_LORA_UPDATING=True plus --enable-lora for a LoRA actor's adapter
    pushes); null = ppo.py starts one as its child, logging to output_dir/rollout_server.log, and stops it with the
    run"""
    cpus: str = ""
    """the child server's CPU cores, as taskset writes them (e.g. 1 or 2-3; its OpenMP threads are bound to them);
    empty = every core"""
    devices: str = ""
    """the child server's GPUs (its CUDA_VISIBLE_DEVICES, e.g. 1); empty = as this process sees them"""
    start_timeout_s: float = 600.0
    """seconds the child server may take to answer its first request"""
    max_concurrency: int = 64
    """requests (one per prompt) in flight at once from each process"""
    timeout_s: float = 300.0
    """seconds one request to the server may take (a prompt's completions, a weight push, the start-up GET
    /v1/models): a server that accepts the connection but has not answered by then stops the run in one sentence
    naming this key"""
    lora_push: Literal["adapter", "merged"] = "adapter"
    """a LoRA actor's weights to the server: adapter (vLLM's runtime LoRA loading, small) or merged (W + s·B·A as
    full weights, reloaded in place, as the colocated engine gets them: on one EPYC core the server generated the
    main job's batch in 45.0 s with the adapter, 2.95 s merged)"""


@dataclass
class RolloutConfig:
    name: str = "vllm"
    """generation backend, a name in rollout.KINDS: vllm (an engine in each training process), hf (generate on the
    training model itself), server (a vLLM server process: rollout.server.*); vllm falls back to hf (with a
    warning) where vLLM cannot be imported"""
    steps_ahead: int = 0
    """generate each step's batch this many steps before it trains, from the policy as it was then, in a background
    thread while the steps before it train (ppo.py's departure 8); 0 = the synchronous loop. A batch is never older
    than this (rollout/staleness_max); needs a backend with its own weights (vllm or server)"""
    background: bool = True
    """with steps_ahead > 0, generate in the background thread; false generates the same batches from the same
    weights in turn, without overlap (to debug, and to check that the thread changes nothing)"""
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
    mean@k, unbiased pass@k and, where the rule names its answer, maj@k per data_source (Scorer.validation_metrics);
    at most 1024"""
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
    """tool calls between assistant turns (agents/multi_turn.py)"""
    server: ServerConfig = field(default_factory=ServerConfig)
    """rollout.name=server: the vLLM server process"""


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
    """stop (after a checkpoint) when kl/mean (k1 to the reference), averaged over the last max_kl_window steps,
    exceeds this; the reference's log-probs are computed for it whatever the KL terms, a no-grad forward a step
    (with LoRA the adapter-off actor, else a frozen copy of the model) (0 = never, and no reference forward)"""
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
    """a validation metric (e.g. val/score/mean, val/perplexity): the checkpoint where it was best (best_metric_mode)
    is kept in output_dir/best/, which keep_checkpoints never deletes (export it with tools/export.py); null = off"""
    best_metric_mode: Literal["auto", "max", "min"] = "auto"
    """whether a higher (max) or lower (min) best_metric is better; auto: min for a name ending in perplexity or
    loss, max for any other (scores, pass@k)"""
    rollback_tolerance: Optional[float] = None
    """when best_metric is worse than rollback_baseline by more than this at a validation, restore best/'s weights,
    optimiser states and β and train on from there (the step count, data order and LR schedule go on); null = never"""
    rollback_baseline: Literal["best", "pretrained"] = "best"
    """what rollback_tolerance measures from: best_metric's best so far, or its value at the validation before
    training (the pre-trained model's; needs val_before_train), rolling back to best/ where one exists and stopping
    the run, without final/, where none does yet (e.g. val/perplexity: never train on from a model worse than the
    one the run started from)"""
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
    model_path: str = ModelConfig.path  # the demo model, ppo.py's policy too
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
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=5e-4))
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


# The range of every number, by field name (a name means the same thing in every section). Any number not
# listed must be ≥ 0. Every number must be finite; a list (betas) is checked element by element.
RANGES = {
    "[1, 1024]": "val_n",
    "[1, inf)": "n max_num_gen_batches train_batch_size max_prompt_length max_response_length micro_batch_size "
                "ppo_epochs ppo_mini_batch_size ppo_micro_batch_size_per_device log_prob_micro_batch_size_per_device "
                "max_token_len_per_device horizon total_steps max_kl_window batch_size micro_batch_size_per_device "
                "max_length lora_alpha max_turns max_tool_response_length max_tokens max_concurrency",
    "(0, inf)": "beta lr target_kl max_grad_norm rollout_is_threshold rollout_rs_threshold clip timeout_s tool_timeout_s "
                "env_timeout_s max_abs_score",
    "(0, 1]": "top_p gpu_memory_utilization",
    "[0, 1)": "lora_dropout betas",
    "[0, 0.5)": "label_smoothing",
    "[0, 1]": "gamma lam warmup_ratio min_lr_ratio clip_ratio_low",
    "(1, inf)": "clip_ratio_c",
    "[-1, inf)": "top_k",
    "(-inf, inf)": "weights overlong_penalty min_score max_score",
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
                   "reward_model.target_modules", "reward_model.lora_top_layers", "reward_model.batch_size"} | {
                   f"{stage}.{key}" for stage in ("sft", "dpo") for key in ("model_path", "tokenizer_path", "lora_rank",
                   "lora_alpha", "target_modules", "lora_top_layers", "batch_size")}


def load_target(target):
    """A table's entry: itself, or for "package.module:Name[.attr]" that object, its module imported now. How a
    stage's table line names what a feature folder holds, so that a run that does not select it never imports it."""
    if not isinstance(target, str):
        return target
    module, _, name = target.partition(":")
    return functools.reduce(getattr, name.split("."), importlib.import_module(module))

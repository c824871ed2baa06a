"""The offline stages' config keys: sft.py reads `SFTStage` (the `sft:` section of configs.yaml), dpo.py `DPOStage`
(`dpo:`). They share OfflineFields: the model, the LoRA and run fields (infra/config.py's), the data, the sizes, the
optimiser and the greedy validation on the task's prompts that PPO runs too (val/score/mean, one yardstick for SFT,
DPO and PPO). Each key: its type, its default (written once: here, or infra/config.py's where ppo.py's must be the
same, as the demo model and that validation) and, in the string under it, its meaning.
"""
from dataclasses import dataclass, field
from typing import Literal, Optional

from infra.config import DataConfig, LoRAFields, ModelConfig, ModelFolderFields, RolloutConfig, RunFields
from infra.config_rl import OptimConfig


@dataclass
class OfflineFields(LoRAFields, RunFields, ModelFolderFields):
    model_path: str = ModelConfig.path  # the demo model, ppo.py's policy too
    """the causal LM to train: a folder (or a hub id); another stage's final/ (sft → dpo) is one"""
    tokenizer_path: Optional[str] = None
    """tokenizer folder; null means model_path. It is saved with final/"""
    dtype: Literal["bf16", "fp32"] = "fp32"
    """compute dtype: bf16 = autocast over fp32 master weights (for GPUs; CPUs without native bf16 run it slower)"""
    lora_rank: int = 16
    """LoRA rank; 0 trains all weights"""
    lora_alpha: int = 32
    gradient_checkpointing: bool = False
    """recompute activations in the backward pass to save memory"""
    use_remove_padding: bool = False
    """pack each micro-batch into one row without padding, each distinct prompt once, as ppo.py packs
    (layouts.packed_inputs)"""
    share_prompt_prefix: bool = True
    """without packing: run each distinct prompt of a micro-batch once (a pair's chosen and rejected share it)"""
    train_files: str = "data/preferences/train.parquet"
    """rows to train on (parquet, jsonl or a datasets save_to_disk folder): preference pairs (prompt, chosen,
    rejected; data.load_preferences reads every layout), and for sft.py also messages or prompt + response"""
    val_files: Optional[str] = "data/preferences/val.parquet"
    """held-out rows of the same kind, scored each eval_freq steps (the loss and its metrics); null = none"""
    val_max_rows: int = 100
    """use at most this many of val_files' rows (0 = all)"""
    val_prompts: Optional[str] = DataConfig.val_files  # ppo.py's validation: one yardstick (val/score/mean)
    """RL prompts (data.load_rl_dataset's layout) answered greedily and scored by their data_source's rule, as
    ppo.py validates: val/score/mean; null = none"""
    val_max_samples: int = DataConfig.val_max_samples
    """answer at most this many of val_prompts (0 = all)"""
    max_response_length: int = RolloutConfig.max_response_length
    """most tokens of a validation answer"""
    val_before_train: bool = True
    """answer val_prompts once before the first step"""
    max_length: int = 96
    """longest prompt + response in tokens, after the chat template"""
    overlong: Literal["truncate", "drop"] = "truncate"
    """a longer row: keep the prompt's last tokens (and, when the response alone is too long, its first) or drop it"""
    batch_size: int = 16
    """rows (pairs for dpo.py) per optimiser step, over all processes"""
    micro_batch_size_per_device: int = 16
    """rows per forward/backward on one process; accumulation fills the batch"""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """optimiser"""
    max_grad_norm: float = 1.0
    """gradient clipping norm"""
    total_steps: int = 20
    eval_freq: int = 10
    """validate every N steps (0 = only at the end)"""
    save_freq: int = 10


@dataclass
class SFTConfig(OfflineFields):
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=2e-4))
    output_dir: str = "outputs/sft"
    """metrics.jsonl, config.yaml, checkpoints, final/ (the model, LoRA merged, and tokenizer), final_adapter/"""
    project_name: str = "sft"


@dataclass
class DPOConfig(OfflineFields):
    loss_type: str = "sigmoid"
    """a name in dpo.LOSSES: sigmoid (DPO, Rafailov et al., 2023; with label_smoothing, conservative DPO), ipo
    (Azar et al., 2023) or simpo (Meng et al., 2024: no reference, length-normalised)"""
    beta: float = 0.1
    """β: DPO's KL strength (the rewards are β·log π/π_ref); IPO's τ; SimPO's reward scale"""
    label_smoothing: float = 0.0
    """ε, the share of pairs taken to be mislabelled (conservative DPO; sigmoid and simpo)"""
    simpo_gamma: float = 0.5
    """SimPO's target margin γ between the length-normalised rewards (TRL's CPOConfig.simpo_gamma)"""
    precompute_ref_log_probs: bool = False
    """compute the reference's log-probs of every training pair once before the first step (one pass, no grad),
    not at every step"""
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=5e-4))
    output_dir: str = "outputs/dpo"
    """metrics.jsonl, config.yaml, checkpoints, final/ (the model, LoRA merged, and tokenizer), final_adapter/"""
    project_name: str = "dpo"


@dataclass
class SFTStage:
    """sft.py's keys: one section, `sft:` in configs.yaml."""
    sft: SFTConfig = field(default_factory=SFTConfig)
    """supervised fine-tuning (sft.py)"""


@dataclass
class DPOStage:
    """dpo.py's keys: one section, `dpo:` in configs.yaml."""
    dpo: DPOConfig = field(default_factory=DPOConfig)
    """direct preference optimisation (dpo.py)"""

#!/usr/bin/env bash
# GRPO with LoRA on GSM8K, Qwen2.5-0.5B-Instruct, with the settings of verl's published GRPO-LoRA run:
# 54.3 on GSM8K test (verl docs/algo/baseline.md; the run's script and log:
# github.com/eric-haibin-lin/verl-data, gsm8k/Qwen2.5-0.5B-bsz64_2-prompt512-resp1024-lorarank32-score0.543.log).
#
#   bash examples/gsm8k_qwen05b_grpo_lora.sh                    # one GPU; data step included
#   bash examples/gsm8k_qwen05b_grpo_lora.sh trainer.total_steps=20
#
# Not run here (no GPU, no model hub); tests/test_examples.py runs these exact overrides for one step with
# a tiny model and tiny GSM8K files swapped in.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -d .venv/bin ] && export PATH="$PWD/.venv/bin:$PATH"
DATA=${GSM8K_DATA:-data/gsm8k}
GSM8K_DATA=$DATA bash examples/prepare_gsm8k.sh

overrides=(
    # verl's run: 64 prompts per step, 5 samples each, one epoch in file order (7473 // 64 = 116 steps);
    # prompts ≤ 512 tokens, responses ≤ 1024; every test question scored greedily every 5 steps
    model.path=Qwen/Qwen2.5-0.5B-Instruct
    data.train_files=$DATA/train.parquet data.val_files=$DATA/test.parquet data.val_max_samples=0
    data.train_batch_size=64 data.max_prompt_length=512 data.shuffle=false
    rollout.name=vllm rollout.n=5 rollout.temperature=1.0 rollout.max_response_length=1024
    rollout.val_temperature=0 rollout.gpu_memory_utilization=0.4 rollout.dtype=bf16
    # LoRA rank 32, alpha 32, on every linear layer of every decoder layer; the reference is the base
    # (adapter disabled), so no second copy; gradient checkpointing as verl's run
    model.lora_rank=32 model.lora_alpha=32 model.lora_top_layers=0
    model.target_modules=q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj
    model.dtype=bf16 model.use_remove_padding=true model.gradient_checkpointing=true
    # GRPO (group mean/std over the 5 samples), k3 KL loss 0.001, no KL in the reward
    algorithm.adv_estimator=grpo algorithm.norm_adv_by_std_in_grpo=true algorithm.use_kl_in_reward=false
    algorithm.use_kl_loss=true algorithm.kl_loss_coef=0.001 algorithm.kl_loss_type=k3
    # actor: lr 3e-5 constant, weight decay 0.01, one mini-batch (the whole step), clip 0.2, entropy 0.001
    actor.optim.lr=3e-5 actor.optim.lr_scheduler=constant actor.optim.warmup_ratio=0 actor.optim.weight_decay=0.01
    actor.ppo_epochs=1 actor.ppo_mini_batch_size=64 actor.clip_ratio_low=0.2 actor.clip_ratio_high=0.2
    actor.clip_ratio_c=3.0 actor.entropy_coef=0.001 actor.loss_agg_mode=token-mean actor.max_grad_norm=1.0
    # memory only: sequences per forward/backward
    actor.ppo_micro_batch_size_per_device=32 actor.log_prob_micro_batch_size_per_device=64
    reward.type=rule
    trainer.total_steps=116 trainer.test_freq=5 trainer.val_before_train=true trainer.max_kl=0
    trainer.save_freq=20 trainer.keep_checkpoints=1 trainer.output_dir=outputs/gsm8k_qwen05b_grpo_lora
    trainer.experiment_name=gsm8k_qwen05b_grpo_lora
)

accelerate launch --num_processes "${NUM_PROCESSES:-1}" --num_machines 1 --mixed_precision no \
    --dynamo_backend no ppo.py --config configs.yaml "${overrides[@]}" "$@"

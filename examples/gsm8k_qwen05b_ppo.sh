#!/usr/bin/env bash
# PPO with a critic on GSM8K: Qwen2.5-0.5B-Instruct as actor and critic, with the settings of verl's
# published baseline. verl reports 56.7 on GSM8K test after PPO, from 36.4 for the checkpoint
# (verl docs/algo/baseline.md and docs/algo/ppo.md "Reference Example"; the run's command and full log:
# github.com/eric-haibin-lin/verl-data, gsm8k/Qwen2.5-0.5B-bsz256_2-prompt1024-resp512-0.567.log, whose
# final line reads test_score 0.5686). Qwen's own report gives 49.6 for the checkpoint, with its own prompt.
#
#   bash examples/gsm8k_qwen05b_ppo.sh                          # one GPU; data step included
#   NUM_PROCESSES=8 bash examples/gsm8k_qwen05b_ppo.sh          # DDP over 8 GPUs (same global batch)
#   bash examples/gsm8k_qwen05b_ppo.sh trainer.total_steps=50   # any override, appended: it wins
#
# Not run here (the machine this was written on has no GPU and no model hub); tests/test_examples.py runs
# these exact overrides for one step with a tiny model and tiny GSM8K files swapped in.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -d .venv/bin ] && export PATH="$PWD/.venv/bin:$PATH"
DATA=${GSM8K_DATA:-data/gsm8k}
GSM8K_DATA=$DATA bash examples/prepare_gsm8k.sh

overrides=(
    # verl's run, key by key (its log prints the resolved config): 256 prompts per step, one sample each,
    # 15 epochs of 29 steps = 435 steps; prompts ≤ 1024 tokens, responses ≤ 512; all 1319 test questions
    # scored greedily every 10 steps.
    model.path=Qwen/Qwen2.5-0.5B-Instruct
    data.train_files=$DATA/train.parquet data.val_files=$DATA/test.parquet data.val_max_samples=0
    data.train_batch_size=256 data.max_prompt_length=1024 data.shuffle=true
    rollout.name=vllm rollout.n=1 rollout.temperature=1.0 rollout.max_response_length=512
    rollout.val_temperature=0 rollout.gpu_memory_utilization=0.4 rollout.dtype=bf16
    # every weight trained (no LoRA), bf16 autocast over fp32 master weights as verl's FSDP mixed precision
    model.lora_rank=0 model.dtype=bf16 model.use_remove_padding=true model.gradient_checkpointing=false
    # GAE with γ = λ = 1 and whitened advantages; a k1 KL penalty in the reward, fixed β = 0.001 (verl 0.2
    # put it there always); no KL loss
    algorithm.adv_estimator=gae algorithm.gamma=1.0 algorithm.lam=1.0 algorithm.whiten_advantages=true
    algorithm.use_kl_in_reward=true algorithm.kl_penalty=k1 algorithm.kl_ctrl.type=fixed
    algorithm.kl_ctrl.kl_coef=0.001 algorithm.use_kl_loss=false
    # actor: lr 1e-6 constant, AdamW weight decay 0.01 (verl's default), 4 mini-batches of 64 prompts,
    # one epoch, clip 0.2, entropy bonus 0.001, gradient norm 1. Dual clip (c = 3, verl's default since)
    # did not exist in verl 0.2; it only bounds the loss of ratios above 3 on negative advantages.
    actor.optim.lr=1e-6 actor.optim.lr_scheduler=constant actor.optim.warmup_ratio=0 actor.optim.weight_decay=0.01
    actor.ppo_epochs=1 actor.ppo_mini_batch_size=64 actor.clip_ratio_low=0.2 actor.clip_ratio_high=0.2
    actor.clip_ratio_c=3.0 actor.entropy_coef=0.001 actor.loss_agg_mode=token-mean actor.max_grad_norm=1.0
    # critic: its own Qwen2.5-0.5B-Instruct, every weight trained (critic.model_path null = model.path), lr 1e-5 constant, value
    # clip 0.5, no warm-up
    critic.lora_rank=0 critic.optim.lr=1e-5 critic.optim.lr_scheduler=constant critic.optim.warmup_ratio=0
    critic.optim.weight_decay=0.01 critic.cliprange_value=0.5 critic.vf_coef=1.0 critic.warmup_steps=0
    # memory only (no effect on the maths): sequences per forward/backward
    actor.ppo_micro_batch_size_per_device=8 actor.log_prob_micro_batch_size_per_device=16
    critic.ppo_micro_batch_size_per_device=8
    # the strict "#### <n>" rule for data_source openai/gsm8k (reward_rules/verl_rules.gsm8k, verl's gsm8k.py)
    reward.type=rule
    # verl's run has no KL guard, and its per-token k1 KL ends near 0.21: ours would stop it at 0.1
    trainer.total_steps=435 trainer.test_freq=10 trainer.val_before_train=true trainer.max_kl=0
    trainer.save_freq=100 trainer.keep_checkpoints=1 trainer.output_dir=outputs/gsm8k_qwen05b_ppo
    trainer.experiment_name=gsm8k_qwen05b_ppo
)

accelerate launch --num_processes "${NUM_PROCESSES:-1}" --num_machines 1 --mixed_precision no \
    --dynamo_backend no ppo.py --config configs.yaml "${overrides[@]}" "$@"
